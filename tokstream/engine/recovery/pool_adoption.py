"""An engine core takes over the gateway's KV pool files: it claims their block index and
registers the cached prefixes a dead core left there (adopt), and lets go of the index when
its own rank group stops reading the pool those entries describe (follow_restart). No torch.

The gateway asks for adopt (AdoptPool) once no process outside this core maps the pool files,
and before this core's first request (server/replica/kept_pool.py): until then another core's ranks
may still be writing blocks, and a core that has handed out a block may have written over
what the index lists (BlockManager.attach_index refuses then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokstream.engine.block_index import BlockIndex, layout_signature

if TYPE_CHECKING:
    from tokstream.engine.core import EngineCore


def signature(core: EngineCore) -> bytes | None:
    """What this core's pool bytes mean, or None when a rank's pool is its own (the files
    then hold nothing this core's ranks wrote)."""
    layout = core.executor.group.pool_layout()
    if layout is None or core.executor.pool is None:
        return None
    return layout_signature(layout, core.block_manager.block_size, core.config.model,
                            core.dtype, core.weights)


def adopt(core: EngineCore) -> tuple[int, str | None]:
    """Claim the index: (blocks adopted, None), or (0, why this core keeps no index)."""
    manager = core.block_manager
    if manager.index is not None:
        return 0, "this core keeps the index already"
    own = signature(core)
    if own is None:
        return 0, "the ranks' KV pools are their own (not in the gateway's files)"
    if not manager.enable_caching:
        return 0, "prefix caching is off"
    index = BlockIndex(core.executor.pool.index)
    try:
        entries = index.claim(own, manager.num_blocks)
    except OSError as exc:  # the gateway's file is gone: serve on, keeping no index
        return 0, f"the block index cannot be mapped: {exc}"
    blocks = manager.attach_index(index, entries)
    core.index_signature = own
    core.event("pool_adopted", "", blocks=blocks)
    return blocks, None


def follow_restart(core: EngineCore) -> None:
    """After a rank-group restart: a group that reads the pool some other way than the one the
    index describes (a pool of its own, another layout) leaves the index empty and let go of,
    so that no later core adopts blocks whose bytes are elsewhere."""
    manager = core.block_manager
    if manager.index is not None and signature(core) != core.index_signature:
        manager.index.clear_all()
        manager.index.close()
        manager.index = None
        core.event("pool_index_dropped", "", reason="the new rank group's pool is not the "
                                                    "one the index describes")
