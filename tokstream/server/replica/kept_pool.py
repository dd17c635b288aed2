"""The gateway hands its KV pool files (engine/recovery/pool_files.py) to the engine core that
serves: the first at start, and after an engine-core death the one that takes over, which then
keeps every block the dead core had listed as a cached prefix (engine/recovery/pool_adoption.py),
so that its resumed streams re-prefill only what was not yet in a full block.

A dead core's ranks may still be running the step they were given, writing KV into the pool;
the new core must not hand out a block, nor trust the index, before they are gone. So the
hand-over waits until no process outside the new core's own tree maps any of the files (the
dead core's ranks are being killed meanwhile, by its shutdown); one that lingers past
HAND_OVER_WAIT_S costs the kept blocks (the new core then keeps no index: everything is
re-prefilled, as without the files), never a wrong token.
"""

from __future__ import annotations

import asyncio
import logging
import time

import psutil

from tokstream.engine.async_engine import AsyncEngine
from tokstream.errors import ReplicaError

log = logging.getLogger("tokstream.server")

HAND_OVER_WAIT_S = 5.0
"""The longest a new core waits for the dead one's ranks to let go of the pool."""
HAND_OVER_POLL_S = 0.01


def own_tree(engine: AsyncEngine) -> set[int]:
    """The engine core's process and every process under it (its forkserver, its ranks)."""
    try:
        core = psutil.Process(engine.pid)
        return {core.pid} | {p.pid for p in core.children(recursive=True)}
    except psutil.Error:
        return set()


async def hand_over(engine: AsyncEngine) -> dict:
    """Give engine the pool once nobody else maps it: {"blocks": cached blocks it kept,
    "refused": why it keeps none (None: it keeps the index)}; {} without pool files."""
    pool = engine.pool
    if pool is None or pool.paths() is None:
        return {}
    ours = own_tree(engine)
    deadline = time.monotonic() + HAND_OVER_WAIT_S
    while others := await asyncio.to_thread(lambda: pool.mappers() - ours):
        if time.monotonic() > deadline:
            log.error("processes %s still map the KV pool %g s after the engine core died: "
                      "the new core keeps none of its blocks", sorted(others), HAND_OVER_WAIT_S)
            return {"blocks": 0, "refused": f"pids {sorted(others)} still map the pool"}
        await asyncio.sleep(HAND_OVER_POLL_S)
    try:
        reply = await engine.adopt_pool()
    except ReplicaError as exc:  # the core died meanwhile: its successor is handed the pool
        return {"blocks": 0, "refused": str(exc)}
    if reply.refused is not None:
        log.info("the engine core keeps no KV block index: %s", reply.refused)
    return {"blocks": reply.blocks, "refused": reply.refused}
