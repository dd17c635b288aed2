"""Paged KV bookkeeping: which blocks are free, who holds which. Pure Python, no torch.

The pool itself (per-layer tensors of shape (num_blocks, block_size, kv_heads, head_dim)) lives
in the workers; this class only hands out block ids. A request's block table maps its token
position p to slot block_ids[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections import deque

from tokstream.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that request can hold num_new_tokens more computed tokens."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(request, num_new_tokens) + reserve <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int, reserve: int = 0) -> list[int] | None:
        """Grow request's block table for num_new_tokens more tokens; None if the pool is short."""
        count = self.num_new_blocks(request, num_new_tokens)
        if count + reserve > len(self._free):
            return None
        new_ids = [self._free.popleft() for _ in range(count)]
        for block_id in new_ids:
            self.ref_counts[block_id] = 1
        request.block_ids.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Return request's blocks; a block goes back to the pool when nobody holds it."""
        # Reversed, so the tail of a sequence (least likely to be shared later) is reused first.
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free.append(block_id)
        request.block_ids = []
        request.num_computed_tokens = 0
