"""A CPU kernel's source at a git revision, compiled beside its headers, for the benches that
time a revision's build against the working tree's in one run."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_at(revision: str, work: Path, sources: tuple[str, ...],
             flags: tuple[str, ...]) -> ctypes.CDLL:
    """sources[0] (a file under kernels/) and the headers after it as they were at `revision`,
    compiled with flags in a folder under work; exits if it does not build."""
    from tokstream.kernels import cpu_build

    folder = work / revision.replace("/", "_")
    folder.mkdir(parents=True, exist_ok=True)
    for name in sources:
        text = subprocess.run(["git", "show", f"{revision}:kernels/{name}"], cwd=ROOT,
                              check=True, capture_output=True, text=True).stdout
        (folder / name).write_text(text)
    lib = cpu_build.build(folder / sources[0], flags)
    if lib is None:
        raise SystemExit(f"{sources[0]} at {revision} does not build")
    return lib
