"""Which KV pool blocks hold which cached prefix, written where the next engine core can read
it: the prefix cache's map (BlockManager) published, block by block, into a memory file the
gateway holds beside the pool files (engine/recovery/pool_files.py).

When an engine core dies its bookkeeping dies with it, but the pool it wrote does not: the
gateway holds the files. The core that takes over reads this index (claim) and registers every
listed block as a cached prefix nobody holds (BlockManager.attach_index), so each resumed
stream finds its computed blocks by their prefix hash and only what the index does not list
is prefilled again.

Why a block listed here is safe to read: the core lists a block only after the step that
filled it has come back from every rank (Scheduler.update), and a full block is never written
again until it is handed out anew, which unlists it first (BlockManager._take, reset). A core
that dies halfway through writing an entry leaves bytes that name no prefix. The header names
the pool's layout; a core whose pool means something else starts the index afresh. No torch.

Layout: MAGIC, the 16-byte layout signature, the block count (8 bytes, little-endian), then
one 16-byte entry per block (all zeros: nothing listed).
"""

from __future__ import annotations

import hashlib
import mmap
import os

MAGIC = b"TSKVIDX1"
ENTRY = 16
"""Bytes per block: a prefix hash (block_manager.chain_hash's digest size)."""
HEADER = len(MAGIC) + ENTRY + 8
EMPTY = bytes(ENTRY)


def layout_signature(*facts: object) -> bytes:
    """16 bytes naming what the pool's bytes mean (the ranks' pool layouts, block size, model,
    dtype): two cores read each other's blocks only if they agree on it."""
    return hashlib.blake2b(repr(facts).encode(), digest_size=ENTRY).digest()


class BlockIndex:
    """The index file at path, mapped by one engine core at a time (the gateway sees to that:
    server/replica/kept_pool.py)."""

    def __init__(self, path: str):
        self.path = path
        self._map: mmap.mmap | None = None
        self.num_blocks = 0

    def claim(self, signature: bytes, num_blocks: int) -> dict[int, bytes]:
        """Map the index for a pool of num_blocks blocks with this layout signature and return
        what it lists ({block id: prefix hash}); an index written for another layout (or none
        at all) is started afresh and lists nothing."""
        size = HEADER + ENTRY * num_blocks
        fd = os.open(self.path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.num_blocks = num_blocks
        header = MAGIC + signature + num_blocks.to_bytes(8, "little")
        if self._map[:HEADER] == header:
            return self.entries()
        self._map[:HEADER] = bytes(HEADER)  # unreadable while it is being reset
        self._map[HEADER:] = bytes(size - HEADER)
        self._map[:HEADER] = header
        return {}

    def entries(self) -> dict[int, bytes]:
        """{block id: prefix hash} for every listed block."""
        raw = self._map[HEADER:]
        return {block_id: raw[block_id * ENTRY:(block_id + 1) * ENTRY]
                for block_id in range(self.num_blocks)
                if raw[block_id * ENTRY:(block_id + 1) * ENTRY] != EMPTY}

    def publish(self, block_id: int, block_hash: bytes) -> None:
        offset = HEADER + block_id * ENTRY
        self._map[offset:offset + ENTRY] = block_hash

    def clear(self, block_id: int) -> None:
        offset = HEADER + block_id * ENTRY
        self._map[offset:offset + ENTRY] = EMPTY

    def clear_all(self) -> None:
        self._map[HEADER:] = bytes(ENTRY * self.num_blocks)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
