"""The bounded hand-off from the demux to one caller's writer: a Channel holds the DeltaBatch
(the merged deltas) the caller has not been sent yet.

While its caller lags, new deltas merge into the pending batch (one event carries them all when
the caller catches up); past `max_pending_tokens` put() says so, and the registry cancels the
request (tokstream/server/streaming/streams.py), so a slow caller never stalls the batch or
grows memory.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokstream.engine.messages.request import RequestDelta
from tokstream.engine.messages.worker import TokenLogprobs


@dataclass
class DeltaBatch:
    """What a caller has not been sent yet: merged deltas, in delivery order."""

    token_ids: list[int] = field(default_factory=list)
    """The output token ids, as the deltas brought them."""
    indices: list[int] = field(default_factory=list)
    """Each token's output index (contiguous from its delta's first_index): the integrity
    extension sends them, the last as the event's `id:` line, so the checker can tell a gap, a
    repeat or a reorder."""
    step_ids: list[int] = field(default_factory=list)
    """The engine step that produced each token (its delta's step_id)."""
    request_ids: list[str] = field(default_factory=list)
    """The engine's request id stamped on each token (differs only after a misroute)."""
    text: str = ""
    """The new text of the merged deltas (complete UTF-8, no partial stop string)."""
    final: RequestDelta | None = None
    """The last delta (finish_reason set), once it has arrived."""
    error: tuple[str, str] | None = None
    """(error type, message) when the gateway ends the stream with an error."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Beside token_ids, for a request that asked for log-probabilities."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """One per prompt token (the first None), from the first token's delta, for a request
    that asked (SamplingParams.prompt_logprobs)."""

    def add(self, delta: RequestDelta) -> None:
        n = len(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if n:
            self.token_ids.extend(delta.token_ids)
            self.indices.extend(range(delta.first_index, delta.first_index + n))
            self.step_ids.extend([delta.step_id] * n)
            self.request_ids.extend([delta.request_id] * n)
        self.text += delta.text
        if delta.finished:
            self.final = delta

    def merge(self, later: "DeltaBatch") -> None:
        """Append a later batch's tokens (ids, indices, stamps, log-probabilities) and text."""
        self.token_ids += later.token_ids
        self.indices += later.indices
        self.step_ids += later.step_ids
        self.request_ids += later.request_ids
        self.logprobs += later.logprobs
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.text += later.text

    @property
    def ended(self) -> bool:
        return self.final is not None or self.error is not None


class Channel:
    """Bounded hand-off from the demux to one caller's writer."""

    def __init__(self, max_pending_tokens: int | None):
        self.max_pending_tokens = max_pending_tokens
        self.pending = DeltaBatch()
        self.ready = asyncio.Event()
        self.closed = False

    @property
    def num_pending_tokens(self) -> int:
        return len(self.pending.token_ids)

    def put(self, delta: RequestDelta) -> bool:
        """Queue delta; False when the caller is past the pending limit."""
        self.pending.add(delta)
        self.ready.set()
        limit = self.max_pending_tokens
        return limit is None or len(self.pending.token_ids) <= limit

    def fail(self, error_type: str, message: str) -> None:
        self.pending.error = (error_type, message)
        self.ready.set()

    def take(self) -> DeltaBatch:
        batch, self.pending = self.pending, DeltaBatch()
        self.ready.clear()
        return batch
