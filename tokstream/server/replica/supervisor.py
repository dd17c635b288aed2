"""The gateway's supervisor of its engine core: the replica's status as callers see it, and a
new core whenever the current one dies.

A rank failure is the core's to handle (EngineCore.recover); the supervisor only follows the
status the core reports. When the core process itself dies, the supervisor starts a new
AsyncEngine (a new core and new ranks) and resubmits every live request as its prompt plus
the tokens already delivered to its caller: the engine re-prefills them and goes on at the
next output index. Sampling is a function of (seed, output position) and the gateway fixes
each request's seed when it arrives, so a resumed stream continues exactly as it would have;
its caller sees a pause (SSE pings), never an error. Requests that arrive meanwhile wait in
the registry and are submitted with the others.

After `max_recovery_attempts` failed starts in a row the replica is down: live streams end
with an error event, new requests are refused, and a start is tried again every
`retry_interval_s` until one succeeds. A core that dies within STABLE_CORE_S of starting,
before any stream got a token from it, counts as a failed start too, so a core that keeps
dying at once cannot restart forever.

A request in flight at `max_request_failures` core deaths in a row (no token between them) is
ended with an error instead of being resubmitted (request_failures: only the requests of the
step a core died in are charged). Deaths no request explains keep being resumed, up to
RAPID_DEATHS_LIMIT quick ones in a row: the replica is then down.

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
from tokstream.engine.async_engine import AsyncEngine, kill_tree
from tokstream.server.replica.kept_pool import hand_over
from tokstream.server.replica.request_failures import RequestFailures
from tokstream.server.replica.spare_core import SpareCore
from tokstream.server.streaming.streams import StreamRegistry
from tokstream.state_snapshot import ReplicaStatus

log = logging.getLogger("tokstream.server")

KINDS = ("rank", "core")
"""What a restart replaced: the rank group (by the core) or the engine core (by the gateway)."""
STABLE_CORE_S = 30.0
"""A core that dies sooner than this after it started, having streamed nothing, counts as a
failed start."""
RAPID_DEATHS_LIMIT = 5
"""Engine-core deaths in a row, each within STABLE_CORE_S of that core's start, with no
request to blame for them, before the replica is down (live streams end with an
overloaded_error): the host is failing, not a request."""
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
        self.restarts = {kind: 0 for kind in KINDS}
        self.resumed_requests = {kind: 0 for kind in KINDS}
        self.recovery_seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
        """Rank: the core's time from detecting a failure to a ready group. Core: the gateway's
        time from seeing the core dead to a new core holding every live request."""
        self.on_status: Callable[[ReplicaStatus, str | None], None] | None = None
        """Called with (status, reason) on every status the replica reports or takes."""
        self.on_event: Callable[..., None] | None = None
        """Called with (kind, **fields) for the gateway's event log."""
        self.on_restart: Callable[[str, float | None, int], None] | None = None
        """Called with (kind, seconds or None, resumed requests) after each restart."""
        self._seen = (0, 0, 0)
        """The current core's (restarts, resumed requests, recoveries) already counted."""
        self._task: asyncio.Task | None = None
        self._spares_task: asyncio.Task | None = None
        self._reaping: asyncio.Task | None = None
        """The dead core's shutdown, running beside its replacement."""
        self._starting: AsyncEngine | None = None
        self._closing = False
        self._failed_starts = 0
        """Failed core starts in a row (quick deaths included); reset by a core that lasts."""
        self._rapid_deaths = 0
        """Core deaths in a row, each within STABLE_CORE_S of that core's start, that no
        request was ended for (streams or not); reset by a core that lasts."""
        self._down_reason: str | None = None
        """Why the replica goes down at the next replacement, when it is not failed starts."""
        self._request_failures = RequestFailures(registry, self.config.max_request_failures,
                                                 self._event)
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
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    @property
    def replacing(self) -> bool:
        """True while the engine core is being replaced (or cannot be)."""
        return self._task is not None and not self._task.done()

    def _attach(self, engine: AsyncEngine) -> None:
        engine.keep_requests_on_death = True
        engine.on_status = self._on_core_status
        engine.on_dead = self._on_core_dead
        self._seen = (engine.restarts, engine.resumed_requests, len(engine.recovery_seconds))
        self._attached_at = time.monotonic()
        self._delivered_at_attach = {rid: len(s.delivered)
                                     for rid, s in self.registry.streams.items()}

    def _set_status(self, status: ReplicaStatus, reason: str | None) -> None:
        self.status = status
        if self.on_status is not None:
            self.on_status(status, reason)

    def _event(self, kind: str, **fields) -> None:
        if self.on_event is not None:
            self.on_event(kind, **fields)

    def _count(self, kind: str, seconds: float | None, resumed: int) -> None:
        self.restarts[kind] += 1
        self.resumed_requests[kind] += resumed
        if seconds is not None:
            self.recovery_seconds[kind].append(seconds)
        if self.on_restart is not None:
            self.on_restart(kind, seconds, resumed)

    # --- rank failures: the core recovers, the gateway follows --------------------------------

    def _on_core_status(self, status: ReplicaStatus, reason: str | None) -> None:
        engine = self.engine
        restarts, resumed, recoveries = self._seen
        self._seen = (engine.restarts, engine.resumed_requests, len(engine.recovery_seconds))
        if engine.restarts > restarts:
            seconds = (engine.recovery_seconds[-1] if len(engine.recovery_seconds) > recoveries
                       else None)  # back from down: no recovery time of its own
            self._count("rank", seconds, engine.resumed_requests - resumed)
        self._set_status(status, reason)

    # --- engine core death: the gateway starts another ---------------------------------------

    def _on_core_dead(self, reason: str) -> None:
        if self._closing:
            return
        log.error("engine core (pid %s) died: %s; starting another", self.engine.pid, reason)
        rapid = time.monotonic() - self._attached_at < STABLE_CORE_S
        quick = rapid and not self._progressed()
        culprits = self._request_failures.count_death(self.engine.in_flight())
        if not quick:
            self._failed_starts = 0
        elif not culprits:  # a death a request explains is no failed start: it is gone now
            self._failed_starts += 1
        if not rapid:
            self._rapid_deaths = 0
        elif not culprits:  # one a request explains says nothing of the host
            self._rapid_deaths += 1
        if self._rapid_deaths >= RAPID_DEATHS_LIMIT:
            # The host, not a request, is failing: down now, and tried again later.
            self._failed_starts = max(self._failed_starts, self.config.max_recovery_attempts)
            self._down_reason = (f"the engine core died {self._rapid_deaths} times in a row, "
                                 f"each within {STABLE_CORE_S:g} s of starting, with no "
                                 f"request to blame (last: {reason})")
        self.registry.paused = True
        self._event("engine_dead", reason=reason, pid=self.engine.pid)
        self._set_status(ReplicaStatus.RECOVERING, f"engine core died: {reason}")
        self._task = asyncio.get_running_loop().create_task(self._replace())

    def _progressed(self) -> bool:
        """Did any stream get a token (or end) since the current core started?"""
        before, streams = self._delivered_at_attach, self.registry.streams
        return (any(len(s.delivered) > before.get(rid, 0) for rid, s in streams.items())
                or any(rid not in streams for rid in before))

    async def _replace(self) -> None:
        started = time.monotonic()
        # Reap the dead core and kill what is left of its ranks beside the replacement, which
        # waits for none of it (a rank no longer a child of anyone here can take seconds).
        self._reaping = asyncio.get_running_loop().create_task(self.engine.shutdown())
        attempts = self.config.max_recovery_attempts
        last_error = "the engine core kept dying as soon as it started"
        down_reason, self._down_reason = self._down_reason, None
        swapped = engine = (await self.spare.take()
                            if self.spare is not None and down_reason is None else None)
        while engine is None:
            if self._failed_starts >= attempts:
                if self.status != ReplicaStatus.DOWN:
                    self._go_down(down_reason or f"the engine core failed to start "
                                                 f"{attempts} times: {last_error}")
                await asyncio.sleep(self.retry_interval_s)
            engine, error = await self._start()
            if engine is not None:
                break
            self._failed_starts += 1
            last_error = error
            self._event("engine_restart_failed", reason=error, attempt=self._failed_starts)
        was_down = self.status == ReplicaStatus.DOWN
        self.engine = engine
        self._attach(engine)
        # Before any resumed request: they find the blocks the dead core left by their prefix.
        kept = await hand_over(engine)
        if engine.dead is not None:
            return  # it died meanwhile, and _on_core_dead is replacing it in turn
        with engine.batch():  # one step re-prefills them all (suspects come later)
            resumed = self._request_failures.resubmit(engine)
        seconds = None if was_down else time.monotonic() - started
        self._event("engine_restarted", pid=engine.pid, worker_pids=engine.info["worker_pids"],
                    seconds=seconds, resumed=resumed, spare=swapped is not None,
                    start_times=engine.info["start_times"].as_dict(),
                    kv_blocks_kept=kept.get("blocks", 0), kv_refused=kept.get("refused"))
        self._count("core", seconds, resumed)
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
        self._request_failures.close()
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
        if starting is not None and starting.process.is_alive():
            # Its ranks, still loading, would only notice its death once loaded: end them too.
            await asyncio.to_thread(kill_tree, starting.process)
            starting._remove_run_dir()
        await self.engine.shutdown()


def replacement_config(config: EngineConfig, info: dict) -> EngineConfig:
    """The config of every core that replaces the first: the same KV pool size (on a GPU the
    memory free just after a death is not what it was, and callers were sized to this pool)."""
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                num_blocks=info["num_blocks"]))
