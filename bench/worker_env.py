"""Benches that time a rank's work in their own process run under the environment a rank
gets (tokstream.engine.rank_start.WORKER_ENV: glibc malloc thresholds, torch's transparent huge
pages). glibc reads its variables when the process starts, so the bench starts itself again
with them, once."""

from __future__ import annotations

import os
import sys


def as_a_rank() -> None:
    """Re-executes this Python program with WORKER_ENV set, unless it already is."""
    from tokstream.engine.rank_start import WORKER_ENV

    if all(os.environ.get(k) == v for k, v in WORKER_ENV.items()):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **WORKER_ENV})
