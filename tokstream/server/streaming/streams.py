"""The stream registry and demux: every live request's prompt, delivered tokens and channel.

Deltas from the engine arrive on the event loop (AsyncEngine's reader thread hands them over)
and go, each to its own request's channel (tokstream/server/streaming/channel.py), in order, exactly
once. Past a channel's `max_pending_tokens` the request is cancelled in the engine and the
stream ends with an error, so a slow caller never stalls the batch or grows memory.

The gateway owns each live request (prompt ids + every token delivered), which is what a
restarted engine needs to resume it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tokstream import envs
from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.messages.request import EngineRequest, RequestDelta
from tokstream.errors import ErrorKind
# DeltaBatch too: the writers (sse, responses, choices, the routes) take it from here.
from tokstream.server.streaming.channel import Channel, DeltaBatch  # noqa: F401
from tokstream.sampling_params import SamplingParams
from tokstream.state_snapshot import StreamRow

log = logging.getLogger("tokstream.server")

RECENT_TEXT_CHARS = 2000
"""Tail of each stream's text kept for /v1/state/requests/{id}."""


@dataclass
class Stream:
    """One live request, as the gateway owns it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str | None
    api: str
    channel: Channel
    arrival: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.time)
    delivered: list[int] = field(default_factory=list)
    """Every output token handed to the caller's channel, in output order."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl_sum: float = 0.0
    itl_count: int = 0
    recent_text: deque = field(default_factory=lambda: deque(maxlen=RECENT_TEXT_CHARS))
    """The latest text deltas (at least one character each), for /v1/state/requests/{id}."""
    final: RequestDelta | None = None
    cancelled: str | None = None
    """Why the gateway ended it early (slow caller, disconnect), if it did."""
    in_admission: bool = False
    """Counted in the admission queue (until its first token or its end)."""
    writer: asyncio.Task | None = None
    """The task writing this stream to its caller (cancelled if the caller never drains)."""
    engine_fields: dict = field(default_factory=dict)
    """The EngineRequest's tenant, priority, weight and cache_salt (kept to resubmit it)."""
    submissions: int = 0
    """Engine cores this request was submitted to (more than one after a core restart)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def live(self) -> bool:
        """Still owed tokens by the engine: not finished, not cancelled by the gateway."""
        return self.final is None and self.cancelled is None

    @property
    def waiting(self) -> bool:
        """No output yet: still queued or in prefill (what admission bounds)."""
        return self.first_token_time is None and self.final is None

    def row(self, now: float) -> StreamRow:
        """Gateway-side view for /v1/state (the core's state and blocks are joined later)."""
        ttft = (self.first_token_time - self.arrival) if self.first_token_time else None
        decode_s = ((self.last_token_time or now) - self.first_token_time
                    if self.first_token_time else None)
        n = len(self.delivered)
        return StreamRow(
            id=self.request_id, tenant=self.tenant, api=self.api,
            prompt_tokens=self.num_prompt_tokens, output_tokens=n,
            max_tokens=self.params.max_tokens,
            ttft_ms=ttft * 1000 if ttft is not None else None,
            itl_ms=self.itl_sum / self.itl_count * 1000 if self.itl_count else None,
            tokens_per_s=(n - 1) / decode_s if decode_s and n > 1 else None,
            age_s=now - self.arrival, pending_tokens=self.channel.num_pending_tokens,
            cancelled=self.cancelled, resumes=max(self.submissions - 1, 0))


Reroute = Callable[[RequestDelta, dict[str, Stream]], list[tuple[Stream, RequestDelta]]]
"""A demux hook: (delta, live streams) -> the (stream, delta) pairs to deliver instead."""


class StreamRegistry:
    def __init__(self, engine: AsyncEngine, metrics=None, max_pending_tokens: int = 4096,
                 slow_client_grace_s: float = 30.0):
        self.engine = engine
        self.metrics = metrics
        self.max_pending_tokens = max_pending_tokens
        self.slow_client_grace_s = slow_client_grace_s
        self.streams: dict[str, Stream] = {}
        self.on_finish = None
        """Called with (stream, final delta) when a request ends in the engine."""
        self.on_cancel = None
        """Called with (stream, reason) when the gateway cancels a request."""
        self.on_first_token = None
        """Called with (stream) when a request's first output token arrives."""
        self.paused = False
        """True while the engine core is being replaced: new streams are registered, and
        submitted with the live ones once a new core is up (ReplicaRecovery.resubmit)."""
        self.reroute: Reroute | None = None
        """TEST ONLY, None in production: the chaos side's demux mutation
        (tokstream.chaos.demux_mutation, installed by serve's hidden --demux-mutation flag)
        routes deltas here to prove the integrity checker catches a corrupt demux."""
        if envs.DEMUX_MUTATION.is_set():
            log.warning("%s is set but ignored (the test-only switch is serve's hidden "
                        "--demux-mutation flag)", envs.DEMUX_MUTATION.name)

    def __len__(self) -> int:
        return len(self.streams)

    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             tenant: str | None, api: str, bounded: bool = True,
             engine_fields: dict | None = None) -> Stream:
        """Register a stream and submit its request to the engine (engine_fields: the
        EngineRequest's tenant, priority, weight, cache_salt)."""
        channel = Channel(self.max_pending_tokens if bounded else None)
        stream = Stream(request_id, prompt_token_ids, params, tenant, api, channel,
                        engine_fields=dict(engine_fields or {}))
        self.streams[request_id] = stream
        if self.paused:
            return stream
        try:
            self.submit(stream)
        except Exception:
            del self.streams[request_id]
            raise
        return stream

    def engine_request(self, stream: Stream) -> EngineRequest:
        """stream as an engine core takes it: prompt, params, and every token already
        delivered (a resumed request is re-prefilled from those and goes on at the next
        index)."""
        return EngineRequest(stream.request_id, stream.prompt_token_ids, stream.params,
                             output_token_ids=list(stream.delivered), **stream.engine_fields)

    def submit(self, stream: Stream) -> None:
        """Hand stream to the current engine (again, after a core died: recovery)."""
        self.engine.add_request(self.engine_request(stream), self.deliver)
        stream.submissions += 1

    def fail_live(self, message: str, kind: ErrorKind = ErrorKind.REPLICA) -> int:
        """End every live stream with an error (the replica is down, or the server is
        shutting down); returns how many."""
        live = [s for s in self.streams.values() if s.live]
        for stream in live:
            n = len(stream.delivered)
            self._put(stream, RequestDelta.failure(stream.request_id, message, kind,
                                                   num_output_tokens=n,
                                                   num_prompt_tokens=stream.num_prompt_tokens))
        return len(live)

    def close(self, stream: Stream, reason: str | None = None) -> None:
        """The caller is done with stream (finished, gone, or failed): forget it, and abort it
        in the engine if it is still running there (its blocks free at the next step)."""
        if self.streams.pop(stream.request_id, None) is None:
            return
        stream.channel.closed = True
        if stream.final is None and stream.cancelled is None:
            stream.cancelled = reason or "closed"
            self.engine.forget(stream.request_id)
            if self.on_cancel is not None:
                self.on_cancel(stream, stream.cancelled)

    def deliver(self, delta: RequestDelta) -> None:
        """The demux: called once per engine delta, on the event loop (and with the error
        delta the gateway ends a request with for the engine, server/replica/recovery.py)."""
        stream = self.streams.get(delta.request_id)
        if stream is None:
            return
        if self.reroute is None:
            self._put(stream, delta)
            return
        for target, routed in self.reroute(delta, self.streams):
            self._put(target, routed)

    def _put(self, stream: Stream, delta: RequestDelta) -> None:
        if stream.channel.closed:
            return
        n = len(delta.token_ids)
        if n:
            now = time.monotonic()
            if stream.first_token_time is None:
                stream.first_token_time = now
                if self.metrics is not None:
                    self.metrics.on_first_token(stream, now - stream.arrival)
                if self.on_first_token is not None:
                    self.on_first_token(stream)
            else:
                gap = now - stream.last_token_time
                stream.itl_sum += gap
                stream.itl_count += 1
                if self.metrics is not None:
                    self.metrics.on_token_gap(gap)
            stream.last_token_time = now
            stream.delivered.extend(delta.token_ids)
            if self.metrics is not None:
                self.metrics.on_tokens(stream, n)
        if delta.text:
            stream.recent_text.append(delta.text)
        if delta.finished:
            stream.final = delta
            if self.on_finish is not None:
                self.on_finish(stream, delta)
        within_limit = stream.channel.put(delta)
        if not within_limit and stream.final is None:
            self._cancel_slow(stream)

    def _cancel_slow(self, stream: Stream) -> None:
        limit = stream.channel.max_pending_tokens
        message = (f"client too slow: more than {limit} tokens waiting to be read; "
                   "request cancelled")
        log.warning("%s: %s", stream.request_id, message)
        stream.cancelled = "slow_client"
        self.engine.forget(stream.request_id)
        stream.channel.fail("overloaded_error", message)
        if self.on_cancel is not None:
            self.on_cancel(stream, "slow_client")
        # Its writer, stuck on a full socket, gives up after slow_client_grace_s (sse.py).

    def recent_text(self, stream: Stream) -> str:
        return "".join(stream.recent_text)[-RECENT_TEXT_CHARS:]
