"""The gateway's side of recovery: what it counts of the replica's restarts, whom it blames for
an engine-core death, when those deaths put the replica down, and the live streams handed to
the core that takes over (resubmit). The supervisor (supervisor.py) starts and stops the cores;
this decides and counts. The core's own side, a rank-group failure, is
tokstream/engine/recovery/.

A request that keeps killing engine cores is ended, not resubmitted forever; one that merely
shared a core with a failing host is not (issue 31).

Charged: a death is charged to the requests of the step the core died in
(engine/step_record.py), as the rank path charges a failed step's; one between steps charges
nobody. Only where the record cannot tell is every live request given to that core charged
(a suspect still held back was never given to it). A request's count goes back to 0 at each
token it gets.

Suspects: a request charged `max_request_failures - 1` deaths in a row is a suspect. The next
core is given the others first, and a suspect only once the core has shown it can serve:
each of the others has a token from it (or HOLD_MAX_S passed) and the core has then kept
running for a grace (SUSPECT_GRACE_S, or as long as those first tokens took if longer); then
one suspect at a time, the next once the one before has a token. So a death that follows a
suspect follows it alone (the core also never puts two suspects in one step), and a failing
host that kills each core soon after it serves kills it before any suspect is given to it.
A core that dies with no suspect in its step shows the deaths are the host's: every
suspect's count goes back to 0. A request charged `max_request_failures` deaths in a row is
ended with an error (the user's: it is what kills the cores).

Deaths no request explains: a core that dies within STABLE_CORE_S of starting, before any
stream got a token from it, counts as a failed start; `max_recovery_attempts` failed starts
in a row put the replica down. Up to RAPID_DEATHS_LIMIT quick deaths in a row are resumed;
the replica is then down too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.messages.request import RequestDelta, poison_message
from tokstream.errors import ErrorKind
from tokstream.server.streaming.streams import Stream, StreamRegistry

KINDS = ("rank", "core")
"""What a restart replaced: the rank group (by the core) or the engine core (by the gateway)."""
STABLE_CORE_S = 30.0
"""A core that dies sooner than this after it started, having streamed nothing, counts as a
failed start."""
RAPID_DEATHS_LIMIT = 5
"""Engine-core deaths in a row, each within STABLE_CORE_S of that core's start, with no
request to blame for them, before the replica is down (live streams end with an
overloaded_error): the host is failing, not a request."""
HOLD_MAX_S = 10.0
"""The longest a suspect waits for the other streams' first tokens from a new core."""
SUSPECT_GRACE_S = 2.0
"""How long a new core must keep running after the others' first tokens before a suspect is
given to it. Without it the first suspect went in ~50 ms after those tokens, while a host
that kills each core as it serves (chaos rapid-core-deaths: 0.2-0.35 s after a resubmit)
was still about to: the suspect was in the dying step and ended for deaths it did not
cause."""
RELEASE_POLL_S = 0.05


class ReplicaRecovery:
    """The gateway's recovery bookkeeping for one replica: restart counters by kind, core
    deaths charged per request (suspects held back from a new core), failed starts and quick
    deaths in a row, and the resubmission of every live stream to a new core."""

    def __init__(self, registry: StreamRegistry, max_request_failures: int,
                 max_recovery_attempts: int, on_event: Callable[..., None]):
        self.registry = registry
        self.limit = max_request_failures
        """EngineConfig.max_request_failures."""
        self.suspect_after = max(1, max_request_failures - 1)
        """Deaths in a row that make a request a suspect (as the core's scheduler counts)."""
        self.max_recovery_attempts = max_recovery_attempts
        """Failed core starts in a row before the replica is down."""
        self.on_event = on_event
        """Called with (kind, **fields) for the gateway's event log (request_failed...)."""
        self.restarts = {kind: 0 for kind in KINDS}
        self.resumed_requests = {kind: 0 for kind in KINDS}
        self.recovery_seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
        """Rank: the core's time from detecting a failure to a ready group. Core: the gateway's
        time from seeing the core dead to a new core holding every live request."""
        self.on_restart: Callable[[str, float | None, int], None] | None = None
        """Called with (kind, seconds or None, resumed requests) after each restart."""
        self._seen = (0, 0, 0)
        """The current core's (restarts, resumed requests, recoveries) already counted."""
        self._attached_at = time.monotonic()
        self._delivered_at_attach: dict[str, int] = {}
        self.failed_starts = 0
        """Failed core starts in a row (quick deaths included); reset by a core that lasts."""
        self._rapid_deaths = 0
        """Core deaths in a row, each within STABLE_CORE_S of that core's start, that no
        request was ended for (streams or not); reset by a core that lasts."""
        self._down_reason: str | None = None
        """Why the replica goes down at the next replacement, when it is not failed starts."""
        self._deaths: dict[str, tuple[int, int]] = {}
        """request id -> (core deaths in a row it was charged, tokens it had then)."""
        self.held: list[Stream] = []
        """Suspects not yet given to the current core, in arrival order."""
        self._release: asyncio.Task | None = None

    # --- the counters ---------------------------------------------------------------------------

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def count(self, kind: str, seconds: float | None, resumed: int) -> None:
        self.restarts[kind] += 1
        self.resumed_requests[kind] += resumed
        if seconds is not None:
            self.recovery_seconds[kind].append(seconds)
        if self.on_restart is not None:
            self.on_restart(kind, seconds, resumed)

    def attached(self, engine: AsyncEngine) -> None:
        """engine is the replica's core from now on."""
        self._seen = (engine.restarts, engine.resumed_requests, len(engine.recovery_seconds))
        self._attached_at = time.monotonic()
        self._delivered_at_attach = {rid: len(s.delivered)
                                     for rid, s in self.registry.streams.items()}

    def follow(self, engine: AsyncEngine) -> None:
        """engine reported a status: count the rank-group restarts it did since the last."""
        restarts, resumed, recoveries = self._seen
        self._seen = (engine.restarts, engine.resumed_requests, len(engine.recovery_seconds))
        if engine.restarts > restarts:
            seconds = (engine.recovery_seconds[-1] if len(engine.recovery_seconds) > recoveries
                       else None)  # back from down: no recovery time of its own
            self.count("rank", seconds, engine.resumed_requests - resumed)

    # --- an engine-core death -------------------------------------------------------------------

    def core_died(self, engine: AsyncEngine, reason: str) -> None:
        """engine, the replica's core, died: charge the requests it was computing (ending those
        at the limit), and count it as a failed start or a quick death if it was one."""
        rapid = time.monotonic() - self._attached_at < STABLE_CORE_S
        quick = rapid and not self._progressed()
        culprits = self.count_death(engine.in_flight())
        if not quick:
            self.failed_starts = 0
        elif not culprits:  # a death a request explains is no failed start: it is gone now
            self.failed_starts += 1
        if not rapid:
            self._rapid_deaths = 0
        elif not culprits:  # one a request explains says nothing of the host
            self._rapid_deaths += 1
        if self._rapid_deaths >= RAPID_DEATHS_LIMIT:
            # The host, not a request, is failing: down now, and tried again later.
            self.failed_starts = max(self.failed_starts, self.max_recovery_attempts)
            self._down_reason = (f"the engine core died {self._rapid_deaths} times in a row, "
                                 f"each within {STABLE_CORE_S:g} s of starting, with no "
                                 f"request to blame (last: {reason})")

    def _progressed(self) -> bool:
        """Did any stream get a token (or end) since the current core started?"""
        before, streams = self._delivered_at_attach, self.registry.streams
        return (any(len(s.delivered) > before.get(rid, 0) for rid, s in streams.items())
                or any(rid not in streams for rid in before))

    def take_down_reason(self) -> str | None:
        """Why the replica must go down now rather than start another core (None: it need
        not, unless its starts keep failing)."""
        reason, self._down_reason = self._down_reason, None
        return reason

    @property
    def out_of_starts(self) -> bool:
        return self.failed_starts >= self.max_recovery_attempts

    def start_failed(self) -> int:
        """A new core failed to start; returns the failed starts in a row now."""
        self.failed_starts += 1
        return self.failed_starts

    # --- requests that keep killing cores -------------------------------------------------------

    def failures(self, stream: Stream) -> int:
        """Deaths in a row charged to stream (0 once it got a token since the last)."""
        failures, tokens = self._deaths.get(stream.request_id, (0, -1))
        return failures if tokens == len(stream.delivered) else 0

    def count_death(self, in_flight: set[str] | None = None) -> int:
        """The current core died computing the requests in_flight (None: unknown, every live
        request it was given): count it against each of them, end those at the limit. Returns
        how many were ended."""
        held = {stream.request_id for stream in self.held}
        self._stop_releasing()
        live = [s for s in self.registry.streams.values() if s.live and s.submissions]
        before = {s.request_id: self.failures(s) for s in live}
        suspects = {rid for rid, n in before.items() if n >= self.suspect_after}
        # The core died with no suspect in its step: the host failed, not they.
        absolved = in_flight is not None and not suspects & in_flight
        counts = {}
        ended = 0
        for stream in live:
            failures = 0 if absolved and stream.request_id in suspects else \
                before[stream.request_id]
            if in_flight is None:  # unknown: every request the core was given
                failures += stream.request_id not in held
            else:
                failures += stream.request_id in in_flight
            counts[stream.request_id] = (failures, len(stream.delivered))
            stream.engine_fields["num_failures"] = failures
            if failures >= self.limit:
                ended += 1
                self.on_event("request_failed", request_id=stream.request_id,
                              failures=failures)
                n = len(stream.delivered)
                self.registry.deliver(RequestDelta.failure(
                    stream.request_id, poison_message(failures, "its process died"),
                    ErrorKind.USER, num_output_tokens=n,
                    num_prompt_tokens=stream.num_prompt_tokens))
        self._deaths = counts
        return ended

    def resubmit(self, engine: AsyncEngine) -> int:
        """Hand every live stream to engine (a new core after the last one died), suspects
        held back (see the module's docstring). Returns how many had run on the old core."""
        registry = self.registry
        registry.engine, registry.paused = engine, False
        resumed = 0
        others: dict[str, int] = {}
        for stream in [s for s in registry.streams.values() if s.live]:
            resumed += stream.submissions > 0
            if self.failures(stream) >= self.suspect_after:
                self.held.append(stream)
                continue
            registry.submit(stream)
            others[stream.request_id] = len(stream.delivered)
        if self.held:
            self._release = asyncio.get_running_loop().create_task(
                self._release_held(engine, others))
        return resumed

    async def _release_held(self, engine: AsyncEngine, others: dict[str, int]) -> None:
        """Give engine the held suspects one at a time: the first once every other stream
        has a token from it (or HOLD_MAX_S passed) and the grace after (SUSPECT_GRACE_S, or
        as long as those tokens took), each next once the one before has one. A death
        meanwhile cancels this (count_death)."""
        streams = self.registry.streams
        started = time.monotonic()
        deadline = started + HOLD_MAX_S
        while any(rid in streams and streams[rid].live and len(streams[rid].delivered) == n
                  for rid, n in others.items()) and time.monotonic() < deadline:
            await asyncio.sleep(RELEASE_POLL_S)
        await asyncio.sleep(max(SUSPECT_GRACE_S, time.monotonic() - started))
        while self.held and engine is self.registry.engine and engine.dead is None:
            stream = self.held.pop(0)
            if not stream.live:
                continue
            tokens = len(stream.delivered)
            self.registry.submit(stream)
            while stream.live and len(stream.delivered) == tokens and engine.dead is None:
                await asyncio.sleep(RELEASE_POLL_S)

    def _stop_releasing(self) -> None:
        if self._release is not None:
            self._release.cancel()
            self._release = None
        self.held = []

    def close(self) -> None:
        self._stop_releasing()
