"""A CPU kernel's source at a git revision, compiled beside its headers, for the benches that
time a revision's build against the working tree's in one run."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_at(revision: str, work: Path, sources: tuple[str, ...],
             flags: tuple[str, ...]) -> ctypes.CDLL:
    """sources[0] (a file under kernels/) and the headers after it as they were at `revision`
    (those it did not have yet left out), compiled with flags in a folder under work; exits if
    it does not build."""
    from tokstream.kernels import cpu_build

    folder = work / revision.replace("/", "_")
    folder.mkdir(parents=True, exist_ok=True)
    for name in sources:
        shown = subprocess.run(["git", "show", f"{revision}:kernels/{name}"], cwd=ROOT,
                               capture_output=True, text=True)
        if shown.returncode and name != sources[0]:
            continue  # a header the revision did not have yet
        shown.check_returncode()
        (folder / name).write_text(shown.stdout)
    lib = cpu_build.build(folder / sources[0], flags)
    if lib is None:
        raise SystemExit(f"{sources[0]} at {revision} does not build")
    return lib


def provenance(revision: str) -> dict:
    """What a revision-against-tree result depends on: both sides, the CPU, the load."""
    import os
    import sys

    import torch

    from tokstream.kernels import cpu_build

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    cpu = cpu_build.cpu_flags()
    return {"base": revision, "base_commit": git("rev-parse", revision),
            "tree_commit": git("rev-parse", "HEAD"),
            "tree_dirty": bool(git("status", "--porcelain", "kernels")),
            "cpu_model": cpu_build.cpu_model(), "cpu_kind": cpu_build.cpu_kind(),
            "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                      "amx_bf16", "amx_int8") if f in cpu],
            "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
            "command": " ".join(sys.argv)}


def timed_row(key: dict, times: dict, **checks) -> dict:
    """One size's result, printed as it is taken: both builds' best seconds (times' "base" and
    "tree") in ms, their ratio, and the outputs' checks."""
    import json

    row = {**key, "base_ms": round(times["base"] * 1e3, 3),
           "tree_ms": round(times["tree"] * 1e3, 3),
           "tree_over_base": round(times["tree"] / times["base"], 3), **checks}
    print(json.dumps(row), flush=True)
    return row


def write(doc: dict, out: str | None) -> None:
    """doc to `out`, or to bench/results/<doc's bench without _bench>-<cpu kind>.json."""
    import json

    from tokstream.kernels import cpu_build

    name = doc["bench"].removesuffix("_bench")
    path = Path(out or ROOT / "bench" / "results" / f"{name}-{cpu_build.cpu_kind()}.json")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
