"""Results of timed probes (dtype choice, native kernel crossovers), kept per machine so a
restart after a failure does not measure again. Keyed by what the result depends on: the CPU's
instruction sets, the torch version, and whatever the caller adds (shapes, kernel source)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from tokstream import envs
from tokstream.kernels import cpu_build


def path(kind: str, *parts: str) -> Path:
    key = hashlib.sha256(" ".join([cpu_build.cpu_signature(), torch.__version__, *parts])
                         .encode()).hexdigest()[:16]
    root = envs.cache_root()
    return root / "tokstream" / "probes" / f"{kind}-{key}.json"


def _busy(load_average: float) -> bool:
    return load_average > (os.cpu_count() or 1)


def load(file: Path) -> dict | None:
    """A stored result, or None when there is none or it was measured on a busy machine
    while this one is now quiet (a better measurement can be had)."""
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or not isinstance(found.get("result"), dict):
        return None
    if _busy(found.get("load_average", 0.0)) and not _busy(os.getloadavg()[0]):
        return None
    return found["result"]


def store(file: Path, result: dict, load_average: float) -> None:
    """Write atomically, with the load average the probe ran under (a probe timed while the
    machine was busier than its cores measured the other jobs too; it is kept, so a busy
    machine does not pay for the probe at every start, and replaced once one is quiet)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"load_average": load_average, "result": result}))
        os.replace(tmp, file)
    except OSError:
        pass  # a cache is an optimisation


def best_time(fn, repeats: int = 5) -> float:
    """Seconds of fn's fastest run out of `repeats`, after one warm-up run (first-touch pages,
    kernel caches): the least disturbed measurement a probe can take."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def best_times(fns: dict, repeats: int = 5) -> dict:
    """best_time of each of `fns` ({name: callable}), their runs taken in turn (a, b, c, a,
    b, c, ...) so that a passing disturbance falls on every contender alike instead of on
    whichever was being timed (a busy minute had made the bfloat16 copies look 1.6x slower
    than int16 at 32 rows on an AMX Xeon, where they are 1.2x faster)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)
    return best
