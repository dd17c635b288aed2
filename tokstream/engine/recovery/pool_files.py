"""The memory files the ranks' CPU KV pools live in, and the block index beside them (one file
per rank position, one for the index), held outside the ranks so that the pools outlive them.

A rank's pool in its own memory dies with it, and every request then has to be re-prefilled
from its first token: at --tp 3 on two cores, 0.3 s a chunk, seconds for a long prompt. A pool
in a file held elsewhere is mapped again by the rank that replaces a dead one, restarted or
the spare, and every block the bookkeeping says is computed still is (worker/shared_pool.py
maps it; recovery.py decides whether to trust it).

Who holds them: `tokstream serve`'s gateway, so that they outlive an engine core too; every
core it starts (the spare core included) maps the same files, and the one that takes over
after a death adopts the blocks the dead one listed in the index (block_index.py,
server/replica/kept_pool.py). An engine core started without them (in-process, tests) makes its own,
which die with it. Nothing is left behind, even after a SIGKILL.

Ranks are forked from a forkserver, not from the holder, so they cannot inherit a descriptor;
they open a file by its path under /proc. No torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def owner_only(name: str) -> int:
    """A new memory file only its owner may open: a memfd is made mode 0777, and anyone
    allowed into the holder's /proc/PID/fd could otherwise read or write every KV block."""
    fd = os.memfd_create(name)
    os.fchmod(fd, 0o600)
    return fd


@dataclass(frozen=True)
class PoolPaths:
    """Where a core's ranks open their pool files, and where the core opens the index."""

    ranks: tuple[str, ...]
    """One per tensor-parallel rank position."""
    index: str


class PoolFiles:
    """One empty memory file per tensor-parallel rank and one for the block index; the first
    rank to map a pool file sizes it, the core that claims the index sizes that."""

    def __init__(self, tp: int):
        self._fds: list[int] = []
        if hasattr(os, "memfd_create"):
            try:
                self._fds = [owner_only(f"tokstream-kv-rank{rank}") for rank in range(tp)]
                self._fds.append(owner_only("tokstream-kv-index"))
            except OSError:
                self.close()  # no shared pools: each rank allocates its own, as before
        self.tp = tp

    def paths(self) -> PoolPaths | None:
        """The files' paths (None: there are none, each rank allocates its own pool)."""
        if not self._fds:
            return None
        paths = [f"/proc/{os.getpid()}/fd/{fd}" for fd in self._fds]
        return PoolPaths(tuple(paths[:-1]), paths[-1])

    def mappers(self) -> set[int]:
        """Every process that has one of the files mapped now (a zombie maps nothing)."""
        if not self._fds:
            return set()
        wanted = set()
        for fd in self._fds:
            stat = os.fstat(fd)
            wanted.add((f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}",
                        str(stat.st_ino)))
        found = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/maps", "rb") as maps:
                    text = maps.read()
            except OSError:
                continue  # gone meanwhile, or not ours to read
            if b"tokstream-kv" not in text:
                continue
            for line in text.decode(errors="replace").splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and (fields[3], fields[4]) in wanted:
                    found.add(int(name))
                    break
        return found

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
