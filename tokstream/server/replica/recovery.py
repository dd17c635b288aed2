"""A request that keeps killing engine cores is ended, not resubmitted forever; one that merely
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
ended with an error (the user's: it is what kills the cores). Deaths no request explains are
the supervisor's to limit (RAPID_DEATHS_LIMIT).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.messages import RequestDelta, poison_message
from tokstream.errors import ErrorKind
from tokstream.server.streaming.streams import Stream, StreamRegistry

HOLD_MAX_S = 10.0
"""The longest a suspect waits for the other streams' first tokens from a new core."""
SUSPECT_GRACE_S = 2.0
"""How long a new core must keep running after the others' first tokens before a suspect is
given to it. Without it the first suspect went in ~50 ms after those tokens, while a host
that kills each core as it serves (chaos rapid-core-deaths: 0.2-0.35 s after a resubmit)
was still about to: the suspect was in the dying step and ended for deaths it did not
cause."""
RELEASE_POLL_S = 0.05


class RequestFailures:
    def __init__(self, registry: StreamRegistry, limit: int,
                 on_event: Callable[..., None]):
        self.registry = registry
        self.limit = limit
        """EngineConfig.max_request_failures."""
        self.suspect_after = max(1, limit - 1)
        """Deaths in a row that make a request a suspect (as the core's scheduler counts)."""
        self.on_event = on_event
        """Called with ("request_failed", request_id=..., failures=...) for each one ended."""
        self._deaths: dict[str, tuple[int, int]] = {}
        """request id -> (core deaths in a row it was charged, tokens it had then)."""
        self.held: list[Stream] = []
        """Suspects not yet given to the current core, in arrival order."""
        self._release: asyncio.Task | None = None

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
                self.registry._deliver(RequestDelta.failure(
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
            registry._submit(stream)
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
            self.registry._submit(stream)
            while stream.live and len(stream.delivered) == tokens and engine.dead is None:
                await asyncio.sleep(RELEASE_POLL_S)

    def _stop_releasing(self) -> None:
        if self._release is not None:
            self._release.cancel()
            self._release = None
        self.held = []

    def close(self) -> None:
        self._stop_releasing()
