"""Results of timed probes (dtype choice, native kernel crossovers), kept per machine so a
restart after a failure does not measure again. Keyed by what the result depends on: the CPU's
instruction sets, the torch version, and whatever the caller adds (shapes, kernel source)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from tokstream.kernels import cpu_build


def path(kind: str, *parts: str) -> Path:
    key = hashlib.sha256(" ".join([cpu_build.cpu_signature(), torch.__version__, *parts])
                         .encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "tokstream" / "probes" / f"{kind}-{key}.json"


def load(file: Path) -> dict | None:
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def store(file: Path, result: dict) -> None:
    """Write atomically, and only from a quiet machine: a probe timed while the load average
    exceeded the cores measured the other jobs, and is not kept."""
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, file)
    except OSError:
        pass  # a cache is an optimisation
