"""The gateway's supervisor of its engine core: the replica's status as callers see it, and a
new core whenever the current one dies.

A rank failure is the core's to handle (engine/recovery/); the supervisor only follows the
status the core reports. When the core process itself dies, the supervisor starts a new
AsyncEngine (a new core and new ranks) and resubmits every live request as its prompt plus
the tokens already delivered to its caller: the engine re-prefills them and goes on at the
next output index. Sampling is a function of (seed, output position) and the gateway fixes
each request's seed when it arrives, so a resumed stream continues exactly as it would have;
its caller sees a pause (SSE pings), never an error. Requests that arrive meanwhile wait in
the registry and are submitted with the others.

After `max_recovery_attempts` failed starts in a row the replica is down: live streams end
with an error event, new requests are refused, and a start is tried again every
`retry_interval_s` until one succeeds. A core that dies within STABLE_CORE_S (recovery.py) of
starting, before any stream got a token from it, counts as a failed start too, so a core that
keeps dying at once cannot restart forever.

What is counted and decided about a death (the restarts by kind, the failed starts and quick
deaths in a row, which requests a death is charged to, which are ended, the resubmission of
the others) is the replica's recovery object's (recovery.py, ReplicaRecovery); this module
starts, swaps and stops the cores.

With `spare_core` (serve --spare-core) a second core stands by loaded (spare_core): a death
swaps it in, and the next spare loads once the resumed streams have their next token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from tokstream.config import EngineConfig
from tokstream.engine.async_engine import AsyncEngine
from tokstream.server.replica.kept_pool import hand_over
from tokstream.server.replica.recovery import ReplicaRecovery
from tokstream.server.replica.spare_core import SpareCore
from tokstream.server.streaming.streams import StreamRegistry
from tokstream.state_snapshot import ReplicaStatus

log = logging.getLogger("tokstream.server")

SPARE_RELOAD_WAIT_S = 60.0
"""The longest the spares wait for the resumed streams' next tokens before loading anyway."""
SPARE_RELOAD_POLL_S = 0.05


class EngineSupervisor:
    def __init__(self, engine: AsyncEngine, registry: StreamRegistry, retry_interval_s: float):
        self.engine = engine
        self.registry = registry
        self.config = replacement_config(engine.config, engine.info)
        self.retry_interval_s = retry_interval_s
        self.status = ReplicaStatus.READY
        """The core's own status, or the supervisor's while it replaces the core."""
        self.on_status: Callable[[ReplicaStatus, str | None], None] | None = None
        """Called with (status, reason) on every status the replica reports or takes."""
        self.on_event: Callable[..., None] | None = None
        """Called with (kind, **fields) for the gateway's event log."""
        self.recovery = ReplicaRecovery(registry, self.config.max_request_failures,
                                        self.config.max_recovery_attempts, self._event)
        """Restart counters, failed starts, core deaths charged per request, resubmission."""
        self._task: asyncio.Task | None = None
        self._spares_task: asyncio.Task | None = None
        self._reaping: asyncio.Task | None = None
        """The dead core's shutdown, running beside its replacement."""
        self._starting: AsyncEngine | None = None
        self._closing = False
        self.pool = engine.pool
        """The KV pool files every core of this replica maps (the gateway's: kept_pool)."""
        self.spare = (SpareCore(self.config, retry_interval_s, self.pool)
                      if self.config.spare_core else None)
        self._attach(engine)
        if self.spare is not None:
            self.spare.on_ready = lambda spare: self._event(
                "spare_core_ready", pid=spare.pid, worker_pids=spare.info["worker_pids"],
                start_times=spare.info["start_times"].as_dict())
            self.spare.load()

    @property
    def replacing(self) -> bool:
        """True while the engine core is being replaced (or cannot be)."""
        return self._task is not None and not self._task.done()

    def _attach(self, engine: AsyncEngine) -> None:
        engine.keep_requests_on_death = True
        engine.on_status = self._on_core_status
        engine.on_dead = self._on_core_dead
        self.recovery.attached(engine)

    def _set_status(self, status: ReplicaStatus, reason: str | None) -> None:
        self.status = status
        if self.on_status is not None:
            self.on_status(status, reason)

    def _event(self, kind: str, **fields) -> None:
        if self.on_event is not None:
            self.on_event(kind, **fields)

    # --- rank failures: the core recovers, the gateway follows --------------------------------

    def _on_core_status(self, status: ReplicaStatus, reason: str | None) -> None:
        self.recovery.follow(self.engine)
        self._set_status(status, reason)

    # --- engine core death: the gateway starts another ---------------------------------------

    def _on_core_dead(self, reason: str) -> None:
        if self._closing:
            return
        log.error("engine core (pid %s) died: %s; starting another", self.engine.pid, reason)
        self.recovery.core_died(self.engine, reason)
        self.registry.paused = True
        self._event("engine_dead", reason=reason, pid=self.engine.pid)
        self._set_status(ReplicaStatus.RECOVERING, f"engine core died: {reason}")
        self._task = asyncio.get_running_loop().create_task(self._replace())

    async def _replace(self) -> None:
        started = time.monotonic()
        # Reap the dead core and kill what is left of its ranks beside the replacement, which
        # waits for none of it (a rank no longer a child of anyone here can take seconds).
        self._reaping = asyncio.get_running_loop().create_task(self.engine.shutdown())
        attempts = self.config.max_recovery_attempts
        last_error = "the engine core kept dying as soon as it started"
        down_reason = self.recovery.take_down_reason()
        swapped = engine = (await self.spare.take()
                            if self.spare is not None and down_reason is None else None)
        while engine is None:
            if self.recovery.out_of_starts:
                if self.status != ReplicaStatus.DOWN:
                    self._go_down(down_reason or f"the engine core failed to start "
                                                 f"{attempts} times: {last_error}")
                await asyncio.sleep(self.retry_interval_s)
            engine, error = await self._start()
            if engine is not None:
                break
            attempt = self.recovery.start_failed()
            last_error = error
            self._event("engine_restart_failed", reason=error, attempt=attempt)
        was_down = self.status == ReplicaStatus.DOWN
        self.engine = engine
        self._attach(engine)
        # Before any resumed request: they find the blocks the dead core left by their prefix.
        kept = await hand_over(engine)
        if engine.dead is not None:
            return  # it died meanwhile, and _on_core_dead is replacing it in turn
        with engine.batch():  # one step re-prefills them all (suspects come later)
            resumed = self.recovery.resubmit(engine)
        seconds = None if was_down else time.monotonic() - started
        self._event("engine_restarted", pid=engine.pid, worker_pids=engine.info["worker_pids"],
                    seconds=seconds, resumed=resumed, spare=swapped is not None,
                    start_times=engine.info["start_times"].as_dict(),
                    kv_blocks_kept=kept.get("blocks", 0), kv_refused=kept.get("refused"))
        self.recovery.count("core", seconds, resumed)
        self._set_status(engine.replica_status, None)
        if self.spare is not None:  # its own task: the replacement is over (see replacing)
            self._spares_task = asyncio.get_running_loop().create_task(
                self._reload_spares(engine))

    async def _reload_spares(self, engine: AsyncEngine) -> None:
        """Once every resumed stream has its next token (or SPARE_RELOAD_WAIT_S passed), the
        new core arms its standby rank group and the next spare core loads: earlier, their
        loading would take the cores from the re-prefill."""
        waiting = {rid: len(s.delivered) for rid, s in self.registry.streams.items() if s.live}
        deadline = time.monotonic() + SPARE_RELOAD_WAIT_S
        while waiting and time.monotonic() < deadline:
            await asyncio.sleep(SPARE_RELOAD_POLL_S)
            streams = self.registry.streams
            waiting = {rid: n for rid, n in waiting.items() if rid in streams
                       and streams[rid].live and len(streams[rid].delivered) == n}
        if engine is self.engine:  # else it died meanwhile: its replacement reloads them
            if self.config.spare:
                engine.arm_spare()
            self.spare.load()

    async def _start(self) -> tuple[AsyncEngine | None, str | None]:
        engine = AsyncEngine(self.config, self.pool)
        self._starting = engine
        try:
            await engine.start()
        except Exception as exc:  # any failure to start is one failed attempt
            log.error("engine core failed to start: %s", exc)
            self._starting = None
            return None, f"{type(exc).__name__}: {exc}"
        self._starting = None
        return engine, None

    def _go_down(self, error: str) -> None:
        message = f"replica down: {error}"
        self._set_status(ReplicaStatus.DOWN, message)
        failed = self.registry.fail_live(message)
        log.error("%s; %d live requests ended; retrying every %g s", message, failed,
                  self.retry_interval_s)

    def stop_restarting(self) -> None:
        """The server is stopping: a core that dies from now on is not replaced."""
        self._closing = True

    async def close(self) -> None:
        """Stop supervising and shut the engine down (and one still starting, and the spare)."""
        self._closing = True
        self.recovery.close()
        starting = self._starting
        if self._spares_task is not None:
            self._spares_task.cancel()
        if self._reaping is not None:
            await asyncio.gather(self._reaping, return_exceptions=True)
        if self.spare is not None:
            await self.spare.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if starting is not None:
            # Its ranks, still loading, would only notice its death once loaded: end them too.
            await asyncio.to_thread(starting.discard)
        await self.engine.shutdown()


def replacement_config(config: EngineConfig, info: dict) -> EngineConfig:
    """The config of every core that replaces the first: the same KV pool size (on a GPU the
    memory free just after a death is not what it was, and callers were sized to this pool)."""
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                num_blocks=info["num_blocks"]))
