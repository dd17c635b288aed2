"""The memory files the ranks' CPU KV pools live in, held by the engine core so that the pools
outlive their ranks.

A rank's pool in its own memory dies with it, and every request then has to be re-prefilled
from its first token: at --tp 3 on two cores, 0.3 s a chunk, seconds for a long prompt. A pool
in a file the core holds (one per rank position, from memfd_create) is mapped again by the
rank that replaces a dead one, restarted or the spare, and every block the core's bookkeeping
says is computed still is (worker/shared_pool.py maps it; recovery.py decides whether to
trust it). The files die with the core: nothing is left behind, even after a SIGKILL.

Ranks are forked from a forkserver, not from the core, so they cannot inherit a descriptor;
they open the file by its path under /proc. No torch.
"""

from __future__ import annotations

import os


class PoolFiles:
    """One empty memory file per tensor-parallel rank; the first rank to map one sizes it."""

    def __init__(self, tp: int):
        self._fds: list[int] = []
        if hasattr(os, "memfd_create"):
            try:
                self._fds = [os.memfd_create(f"tokstream-kv-rank{rank}") for rank in range(tp)]
            except OSError:
                self.close()  # no shared pools: each rank allocates its own, as before
        self.tp = tp

    def path(self, rank: int) -> str | None:
        """Where rank opens its pool file (None: there is none, it allocates its own pool)."""
        if not self._fds:
            return None
        return f"/proc/{os.getpid()}/fd/{self._fds[rank]}"

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
