"""tokstream installs as a wheel, not only as `pip install -e .`: a wheel built from a copy of
the sources (what the image's build context holds), installed into a fresh virtual environment,
imports every module of the source tree from that environment, and finds its profiles and
kernel sources there. The dependencies come from this venv's site-packages (put on the path by
a .pth file), so nothing is downloaded: `pip install --no-deps` installs the wheel alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

from helpers.serving import ROOT
from test_import_graph import modules

SOURCES = ("pyproject.toml", "README.md", "tokstream", "kernels", "chaos", "loadgen",
           "profiles")
"""What the wheel is built from (deploy/Dockerfile copies the same)."""

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]

IMPORT_ALL = """
import importlib, json, sys
from pathlib import Path
names = json.loads(sys.argv[1])
failed = {}
outside = []
for name in names:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
        continue
    if not Path(module.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()):
        outside.append(f"{name}: {module.__file__}")
from tokstream import settings
from tokstream.loadgen import mix
from tokstream.kernels import cpu_small_ops
print(json.dumps({"failed": failed, "outside": outside,
                  "profiles": sorted(p.name for p in settings.PROFILE_DIR.glob("*.toml")),
                  "mixes": sorted(p.name for p in mix.MIX_DIR.glob("*.toml")),
                  "kernels": sorted(p.name for p in Path(cpu_small_ops.__file__).parent.glob("*.c"))}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """The python of a fresh venv holding only the built wheel (and a path to our deps)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    # --no-build-isolation: this venv's setuptools builds it, offline.
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp / "dist"), str(source)],
                           capture_output=True, text=True, timeout=180)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp / "dist").glob("tokstream-*.whl")

    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                              "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    site = subprocess.run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    # Our dependencies, after the venv's own site-packages; this venv's editable tokstream is
    # not installed there (a path in a .pth file does not run that path's .pth files).
    (tmp / "venv" / site.stdout.strip() / "deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_every_module_imports_from_the_installed_wheel(installed, tmp_path):
    # __main__ runs the CLI when imported; the entry-point test below runs it.
    names = sorted(name for name in modules(ROOT) if not name.endswith("__main__"))
    # -I: neither the current folder nor PYTHONPATH can put the checkout on the path.
    result = subprocess.run([installed, "-I", "-c", IMPORT_ALL, json.dumps(names)],
                            capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["failed"] == {}
    assert report["outside"] == [], "imported from outside the wheel's venv"
    assert {"ci.toml", "cpu-smollm2.toml"} <= set(report["profiles"])
    assert "chat.toml" in report["mixes"]
    assert report["kernels"] == sorted(p.name for p in (ROOT / "kernels").glob("*.c"))


def test_the_entry_point_runs_from_the_wheel(installed, tmp_path):
    script = str(installed).removesuffix("python") + "tokstream"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout
