"""A warm spare engine core (serve --spare-core): a second engine core, its rank group loaded,
kept by the gateway so that an engine-core death swaps cores instead of starting one.

The spare holds one rank group and no standby group of its own (with --spare, that would be
one more pool): the core that takes over is asked to arm one (AsyncEngine.arm_spare), and a
new spare core is loaded, once the streams it resumed have their next token
(EngineSupervisor), so that neither load competes with their re-prefill for the cores. A
spare that dies while standing by is replaced after retry_interval_s; its death is no replica
failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from tokstream.config import EngineConfig
from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.recovery.pool_files import PoolFiles

log = logging.getLogger("tokstream.server")


class SpareCore:
    def __init__(self, config: EngineConfig, retry_interval_s: float,
                 pool: PoolFiles | None = None):
        self.config = dataclasses.replace(config, spare=False, spare_core=False)
        self.pool = pool
        """The gateway's KV pool files: the spare's ranks map them as they load, and write
        nothing there until it takes over (kept_pool.hand_over)."""
        self.retry_interval_s = retry_interval_s
        self.engine: AsyncEngine | None = None
        """The spare, loading or loaded (None between a take and the next load)."""
        self.on_ready: Callable[[AsyncEngine], None] | None = None
        """Called with each spare once it is loaded."""
        self._task: asyncio.Task | None = None
        self._closing = False

    @property
    def ready(self) -> bool:
        return (self._task is not None and self._task.done() and not self._task.cancelled()
                and self._task.exception() is None and self.engine.dead is None)

    def load(self, delay_s: float = 0.0) -> None:
        """Start loading a spare in the background (after delay_s), unless one is there."""
        if self._task is None and not self._closing:
            self._task = asyncio.get_running_loop().create_task(self._start(delay_s))

    async def _start(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.engine = engine = AsyncEngine(self.config, self.pool)
        await engine.start()
        engine.on_dead = lambda reason: self._lost(engine, reason)
        if self.on_ready is not None:
            self.on_ready(engine)

    def _lost(self, engine: AsyncEngine, reason: str) -> None:
        if engine is not self.engine or self._closing:
            return
        log.warning("the spare engine core (pid %s) died while standing by: %s; loading "
                    "another in %g s", engine.pid, reason, self.retry_interval_s)
        self.engine, self._task = None, None
        asyncio.get_running_loop().create_task(engine.shutdown())
        self.load(self.retry_interval_s)

    async def take(self) -> AsyncEngine | None:
        """The spare (waiting for it if it is still loading), now the caller's; None if there
        is none or it failed to start. The caller loads the next one (load) when it suits."""
        task, engine = self._task, self.engine
        if task is None:
            return None
        self._task, self.engine = None, None
        try:
            await task
        except Exception as exc:  # noqa: BLE001 - a spare that failed is simply not there
            log.error("the spare engine core failed to start: %s", exc)
            return None
        if engine.dead is not None:
            await engine.shutdown()
            return None
        engine.on_dead = None
        return engine

    async def close(self) -> None:
        self._closing = True
        task, engine = self._task, self.engine
        self._task, self.engine = None, None
        if task is None:
            return
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if engine is None:
            return
        if engine.dead is None and engine.info:
            await engine.shutdown()
        else:  # still loading (or it failed): nothing to ask, end its tree
            await asyncio.to_thread(engine.discard)
