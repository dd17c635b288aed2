"""A rank's CPU KV pool mapped from its pool file (engine/recovery/pool_files.py), so that the rank
(or the engine core) replacing this one after a failure finds every computed block where it
was.

The file's pages read as zeros until written and are backed as they are first written, like
the private pool's (zeroed_memory.py). Where shmem huge pages are off its pages are 4 KiB,
not the private pool's 2 MiB; decode attention over either took the same time within the
noise on the 2-core Xeon (bench/kv_pool_pages.py, bench/results/kv_pool_pages.json).
"""

from __future__ import annotations

import math
import mmap
import os

import torch


def map_pool_file(path: str, nbytes: int) -> mmap.mmap | None:
    """The pool file at path, mapped shared; the first rank to map it sizes it to nbytes. None
    when it cannot be used (unreachable, or sized for another pool): the rank then allocates a
    pool of its own, which dies with it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            os.ftruncate(fd, nbytes)
        elif size != nbytes:
            return None
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def carve(buffer: mmap.mmap, count: int, shape: tuple[int, ...],
          dtype: torch.dtype) -> list[torch.Tensor]:
    """count contiguous tensors of shape, one after another in buffer (each holds a reference
    to the mapping)."""
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    return [torch.frombuffer(buffer, dtype=dtype, count=numel, offset=i * size).view(shape)
            for i in range(count)]


def pool_bytes(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return count * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
