"""Host tensors that read as zeros and cost nothing until written: the CPU KV pool.

torch.zeros writes every byte of the pool as it is allocated. For SmolLM2 at --tp 3 that is
1.3 GiB per rank, and three ranks zeroing at once on two cores took 1.9-3.9 s of every rank
group's start (a restart after a fault included), more than the rest of the load together.
Anonymous memory from mmap is zero by the kernel's guarantee and is backed page by page as the
pool is first written, so a start pays for none of it and a run only for the blocks it uses.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros whose pages are only backed once written."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # As torch's own allocator does for large tensors (THP_MEM_ALLOC_ENABLE): fewer TLB
        # misses when attention gathers blocks from all over the pool.
        buffer.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds a reference to the mapping, which lives as long as the tensor does.
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
