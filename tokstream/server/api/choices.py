"""`n` choices of one OpenAI request: each choice is an engine request of its own (its own
stream, seed, resume and cancel), the n of them one prompt group, so the engine prefills the
prompt once and the prefix cache serves its blocks to the others.

Choice i's engine request id is `choice_request_id(response id, i)` and its seed the request's
seed + i (as vLLM derives them): choice 0 is what the same request with n = 1 gives, and choice
i what a lone request with seed + i gives. Streamed, the choices' chunks interleave, each with
its own `index`; the usage chunk and `[DONE]` follow the last choice's end. A failure of any
choice, or the caller leaving, ends them all. Usage counts the prompt once and sums the
choices' completion tokens, as OpenAI does.

A completions request may hold several prompts (a batch): prompt p's n choices are indices
p*n to p*n + n - 1, each prompt its own prompt group, sampled as that prompt alone would be;
usage sums the prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from tokstream.checker import MAX_CHOICES, choice_request_id
from tokstream.sampling_params import SamplingParams
from tokstream.server.api_errors import ClientGone
from tokstream.server.streaming.responses import _drain, collect, wait_disconnect
from tokstream.server.streaming.sse import EventStreamResponse, sse, stream_failure
from tokstream.server.streaming.streams import DeltaBatch, Stream, StreamRegistry
from tokstream.server.access.tenants import Tenant
from tokstream.server.validation import get_int

SEED_LIMIT = 2**63


def num_choices(body: dict) -> int:
    """The request's `n` (1 to MAX_CHOICES; a 400 naming `n` otherwise)."""
    return get_int(body, "n", 1, minimum=1, maximum=MAX_CHOICES)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice index's params: the request's, with seed + index (choices differ, each one
    reproducible alone)."""
    if index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % SEED_LIMIT)


@dataclass(frozen=True)
class Choice:
    """Which choice of a response a formatter writes: its chunks carry the response's id and
    the choice's index."""

    response_id: str
    index: int = 0
    count: int = 1
    """The response's number of choices (n)."""


@dataclass
class TenantShare:
    """A tenant's reservation for one request (prompt + n x max_tokens), settled once, when
    the last of its choices ends."""

    tenant: Tenant
    reserved: int
    """Output tokens reserved: n x max_tokens."""
    choices_left: int
    background: bool = False
    """A Message Batch's request: outside the tenant's limits (Tenant.admit)."""
    num_output_tokens: int = 0

    def settle(self, num_output_tokens: int) -> None:
        self.num_output_tokens += num_output_tokens
        self.choices_left -= 1
        if self.choices_left == 0:
            self.tenant.settle(self.reserved, self.num_output_tokens, self.background)


def merge_usage(usages: list[dict], n: int = 1) -> dict:
    """The choices' usage as one (n choices a prompt): each prompt once (and its cache hits,
    as its first choice found them), completion tokens summed."""
    firsts = usages[::n]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in usages)
    return {**usages[0], "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def merge_bodies(bodies: list[dict], n: int = 1) -> dict:
    """Non-streamed: the choices' response bodies (each built for one choice; n a prompt) as
    one. The `tokstream` key lists each choice's integrity record, with its prefix-cache
    hits."""
    if len(bodies) == 1:
        return bodies[0]
    choices = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    return {**bodies[0], "choices": choices,
            "usage": merge_usage([body["usage"] for body in bodies], n),
            "tokstream": {"choices": [
                {**body["tokstream"], "index": i,
                 "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}
                for i, body in enumerate(bodies)]}}


async def collect_choices(streams: list[Stream], receive,
                          registry: StreamRegistry) -> list[DeltaBatch]:
    """Every choice's tokens and final delta; if the caller leaves, or one choice fails, every
    choice still running is aborted (the caller finds the failure by stream_failure; the
    aborted choices' batches are empty)."""
    if len(streams) == 1:
        return [await collect(streams[0], receive, registry)]
    drains = {asyncio.ensure_future(_drain(stream)): stream for stream in streams}
    listener = asyncio.ensure_future(wait_disconnect(receive))
    try:
        pending = set(drains)
        while pending:
            done, _ = await asyncio.wait(pending | {listener},
                                         return_when=asyncio.FIRST_COMPLETED)
            if listener in done or any(task.exception() or stream_failure(drains[task])
                                       for task in done if task in pending):
                break
            pending -= done
    finally:
        for task in (*drains, listener):
            task.cancel()
        await asyncio.gather(*drains, listener, return_exceptions=True)
        gone = listener.done() and not listener.cancelled()
        for stream in streams:
            registry.close(stream, "disconnected" if gone else None)
    if gone:
        raise ClientGone(streams[0].request_id)
    finished = [task for task in drains if not task.cancelled()]
    for task in finished:
        if task.exception() is not None:
            raise task.exception()
    return [task.result() if task in finished else DeltaBatch() for task in drains]


@dataclass
class ChoicesBatch:
    """What the choices' caller has not been sent yet: one DeltaBatch per choice."""

    batches: list[DeltaBatch]
    ended: bool = False
    """The response is over: every choice has ended, or one failed (which ends them all)."""

    @property
    def token_ids(self) -> list[int]:
        return [token for batch in self.batches for token in batch.token_ids]

    @property
    def text(self) -> str:
        return "".join(batch.text for batch in self.batches)

    @property
    def final(self):
        return next((b.final for b in self.batches if b.final is not None), None)

    @property
    def error(self) -> tuple[str, str] | None:
        return next((b.error for b in self.batches if b.error is not None), None)


class ChoicesChannel:
    """The choices' channels read as one: one wake-up event, every choice taken at once."""

    def __init__(self, streams: list[Stream]):
        self.streams = streams
        self.ready = asyncio.Event()
        for stream in streams:
            if stream.channel.ready.is_set():
                self.ready.set()
            stream.channel.ready = self.ready
        self._ended = [False] * len(streams)

    @property
    def pending(self) -> ChoicesBatch:
        batches = [stream.channel.pending for stream in self.streams]
        return ChoicesBatch(batches, any(batch.ended for batch in batches))

    def take(self) -> ChoicesBatch:
        batches = [stream.channel.take() for stream in self.streams]
        failed = False
        for i, (stream, batch) in enumerate(zip(self.streams, batches)):
            self._ended[i] |= batch.ended
            failed |= batch.error is not None or (batch.final is not None
                                                  and stream_failure(stream) is not None)
        return ChoicesBatch(batches, all(self._ended) or failed)


class Choices:
    """n streams as the one stream (and registry) an EventStreamResponse writes and closes."""

    def __init__(self, streams: list[Stream], registry: StreamRegistry):
        self.streams = streams
        self.registry = registry
        self.channel = ChoicesChannel(streams)
        self.request_id = streams[0].request_id

    @property
    def slow_client_grace_s(self) -> float:
        return self.registry.slow_client_grace_s

    @property
    def writer(self) -> asyncio.Task | None:
        return self.streams[0].writer

    @writer.setter
    def writer(self, task: asyncio.Task) -> None:
        for stream in self.streams:
            stream.writer = task

    def close(self, _: "Choices", reason: str | None = None) -> None:
        for stream in self.streams:
            self.registry.close(stream, reason)


class ChoicesFormatter:
    """The choices' OpenAI formatters (each writing its own `index`) as one; the usage chunk
    (if asked: the choices' usage merged) and [DONE] follow the last choice's end."""

    def __init__(self, formatters: list, usage, n: int = 1):
        self.formatters = formatters
        self.usage = usage
        """stream -> one choice's usage dict."""
        self.n = n
        """Choices a prompt (merge_usage)."""

    def start(self) -> bytes:
        return b"".join(formatter.start() for formatter in self.formatters)

    def tokens(self, batch: ChoicesBatch) -> bytes:
        return b"".join(formatter.tokens(b) for formatter, b in zip(self.formatters,
                                                                    batch.batches)
                        if b.token_ids or b.text)

    def finish(self, batch: ChoicesBatch) -> bytes:
        body = b""
        for formatter, choice in zip(self.formatters, batch.batches):
            if choice.error is not None:
                return body + self.error(*choice.error)
            if choice.final is not None:
                body += formatter.finish(choice)
                if stream_failure(formatter.stream) is not None:
                    return body  # an error event and [DONE]: the response is over
        return body + self._closing() if batch.ended else body

    def _closing(self) -> bytes:
        first = self.formatters[0]
        body = b""
        if first.include_usage:
            usage = merge_usage([self.usage(f.stream) for f in self.formatters], self.n)
            body = sse(None, {"id": first.choice.response_id, "object": first.object,
                              "created": first.created, "model": first.model, "choices": [],
                              "usage": usage})
        return body + b"data: [DONE]\n\n"

    def error(self, error_type: str, message: str) -> bytes:
        return self.formatters[0].error(error_type, message)

    def ping(self) -> bytes:
        return self.formatters[0].ping()


def choices_response(streams: list[Stream], formatters: list, usage,
                     registry: StreamRegistry, ping_interval_s: float,
                     headers: dict[str, str], n: int = 1) -> EventStreamResponse:
    """The SSE response of every choice (usage, n: see ChoicesFormatter)."""
    if len(streams) == 1:
        return EventStreamResponse(streams[0], formatters[0], registry, ping_interval_s,
                                   headers)
    choices = Choices(streams, registry)
    return EventStreamResponse(choices, ChoicesFormatter(formatters, usage, n), choices,
                               ping_interval_s, headers)
