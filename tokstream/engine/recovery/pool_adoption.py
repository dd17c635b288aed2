"""An engine core takes over the gateway's KV pool files: it claims their block index and
registers the cached prefixes a dead core left there (adopt), and lets go of the index when
its own rank group stops reading the pool those entries describe (follow_restart). No torch.

The gateway asks for adopt (AdoptPool) once no process outside this core maps the pool files,
and before this core's first request (server/replica/kept_pool.py): until then another core's ranks
may still be writing blocks, and a core that has handed out a block may have written over
what the index lists (BlockManager.attach_index refuses then).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tokstream.engine.recovery.block_index import BlockIndex, layout_signature

if TYPE_CHECKING:
    from tokstream.engine.block_manager import BlockManager
    from tokstream.engine.executor import Executor


class PoolAdoption:
    """The core's claim on the pool files' block index: what it reads of the executor (its
    rank group's pool layout, the pool's paths, dtype and weights) and of the block manager."""

    def __init__(self, executor: Executor, block_manager: BlockManager, model: str,
                 event: Callable[..., None]):
        self.executor = executor
        self.block_manager = block_manager
        self.model = model
        """EngineConfig.model, part of what the pool's bytes mean."""
        self.event = event
        """The core's event log (EngineCore.event)."""
        self.index_signature: bytes | None = None
        """The pool layout the block index was claimed for (adopt)."""

    def signature(self) -> bytes | None:
        """What this core's pool bytes mean, or None when a rank's pool is its own (the files
        then hold nothing this core's ranks wrote)."""
        executor = self.executor
        layout = executor.group.pool_layout()
        if layout is None or executor.pool is None:
            return None
        return layout_signature(layout, self.block_manager.block_size, self.model,
                                executor.ready.dtype, executor.ready.weights)

    def adopt(self) -> tuple[int, str | None]:
        """Claim the index: (blocks adopted, None), or (0, why this core keeps no index)."""
        manager = self.block_manager
        if manager.index is not None:
            return 0, "this core keeps the index already"
        own = self.signature()
        if own is None:
            return 0, "the ranks' KV pools are their own (not in the gateway's files)"
        if not manager.enable_caching:
            return 0, "prefix caching is off"
        index = BlockIndex(self.executor.pool.index)
        try:
            entries = index.claim(own, manager.num_blocks)
        except OSError as exc:  # the gateway's file is gone: serve on, keeping no index
            return 0, f"the block index cannot be mapped: {exc}"
        blocks = manager.attach_index(index, entries)
        self.index_signature = own
        self.event("pool_adopted", "", blocks=blocks)
        return blocks, None

    def follow_restart(self) -> None:
        """After a rank-group restart: a group that reads the pool some other way than the one
        the index describes (a pool of its own, another layout) leaves the index empty and let
        go of, so that no later core adopts blocks whose bytes are elsewhere."""
        manager = self.block_manager
        if manager.index is not None and self.signature() != self.index_signature:
            manager.index.clear_all()
            manager.index.close()
            manager.index = None
            self.event("pool_index_dropped", "",
                       reason="the new rank group's pool is not the one the index describes")
