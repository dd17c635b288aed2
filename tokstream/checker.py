"""The stream integrity checker: given recorded SSE streams, report what went wrong.

Torch-free and server-free, so tests, `chaos` and `loadtest` share it. It reads the
`tokstream` extension every tokstream stream carries (Anthropic and OpenAI wire formats
alike): each token-carrying event has its token ids, the output indices the engine stamped on
them and the engine's request id; the final event has the output token count and the digest
the engine core computed from its own record (see tokstream.engine.messages.token_digest).

Each stream is classified `complete` (a final event), `failed` (an explicit error event) or
`cut` (neither: the stream never ended), and every problem is listed:
lost, duplicated, reordered and foreign tokens, streams that never ended or ended twice,
events after the end, count and digest mismatches.

A response with n > 1 choices (OpenAI's `n`) interleaves n streams, each its own engine
request (`choice_request_id`), its events told apart by `choices[0].index`. The checker reads
each choice as a stream of its own, so a token that strays into another choice is foreign and
a choice that never came (RecordedStream.num_choices says how many were asked for) is cut.

    recorder = SSERecorder()
    for chunk in response.iter_bytes(): recorder.feed(chunk)
    report = check_streams([recorder.stream()])
    assert report.ok, report.summary()
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokstream.engine.messages.request import token_digest

INTEGRITY_HEADER = "x-tokstream-integrity"
"""A request header: '1' asks tokstream serve for the integrity framing this checker reads
(id: lines carrying each event's last token index; keep-alive comments on OpenAI routes),
which stock clients (vllm bench serve, GuideLLM) cannot parse and so is not the default."""
OPT_IN = {INTEGRITY_HEADER: "1"}

MAX_CHOICES = 16
"""Most choices (OpenAI's `n`) one request may ask for."""
MAX_RESPONSE_CHOICES = 256
"""Most choices one response may hold: a completions request's prompts x n. Each is an engine
request and a stream of its own; evaluation harnesses batch 8 to 64 prompts."""

PROBLEM_KINDS = ("lost", "duplicated", "reordered", "foreign", "never_ended", "ended_twice",
                 "after_end", "count_mismatch", "digest_mismatch", "malformed")


@dataclass
class SSEEvent:
    event: str | None
    data: str
    id: str | None = None

    def json(self):
        return json.loads(self.data)

    def json_object(self) -> dict | None:
        """The data as a JSON object; None for anything else (`[DONE]`, a bare value)."""
        try:
            data = self.json()
        except ValueError:
            return None
        return data if isinstance(data, dict) else None


class SSERecorder:
    """Incremental SSE parser: feed it bytes as they arrive, read back the events."""

    def __init__(self):
        self.events: list[SSEEvent] = []
        self._buffer = b""
        self._event: str | None = None
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse what chunk completes; returns the events it finished."""
        self._buffer += chunk
        new: list[SSEEvent] = []
        while True:
            line, sep, rest = self._buffer.partition(b"\n")
            if not sep:
                break
            self._buffer = rest
            event = self._line(line.rstrip(b"\r").decode("utf-8"))
            if event is not None:
                new.append(event)
        self.events.extend(new)
        return new

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if self._event is None and not self._data:
                self._id = None
                return None
            event = SSEEvent(self._event, "\n".join(self._data), self._id)
            self._event, self._data, self._id = None, [], None
            return event
        if line.startswith(":"):
            return None  # a comment (OpenAI-route keep-alive)
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None

    def stream(self, request_id: str | None = None) -> "RecordedStream":
        return RecordedStream(list(self.events), request_id)


def parse_sse(text: str | bytes) -> list[SSEEvent]:
    recorder = SSERecorder()
    recorder.feed(text.encode() if isinstance(text, str) else text)
    recorder.feed(b"\n")
    return recorder.events


@dataclass
class RecordedStream:
    events: list[SSEEvent]
    request_id: str | None = None
    """The id the caller expects (defaults to the id of the stream's first event)."""
    num_choices: int | None = None
    """Choices the caller asked for (OpenAI's `n`); None: as many as the events show."""


def choice_request_id(response_id: str, index: int) -> str:
    """The engine request id of choice `index` of a response (choice 0 is the response)."""
    return response_id if index == 0 else f"{response_id}-{index}"


@dataclass
class StreamReport:
    request_id: str | None
    status: str
    """complete | failed | cut"""
    token_ids: list[int] = field(default_factory=list)
    """Received tokens in index order (first occurrence of each index)."""
    received: list[int] = field(default_factory=list)
    """Every token received, in arrival order (what the digest is checked against)."""
    problems: list[tuple[str, str]] = field(default_factory=list)
    """(kind, detail) for every problem found."""
    finish_reason: str | None = None
    error: dict | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class CheckReport:
    streams: list[StreamReport]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.streams)

    def count(self, kind: str) -> int:
        return sum(1 for s in self.streams for k, _ in s.problems if k == kind)

    @property
    def counts(self) -> dict[str, int]:
        return {kind: self.count(kind) for kind in PROBLEM_KINDS}

    @property
    def statuses(self) -> dict[str, int]:
        out = {"complete": 0, "failed": 0, "cut": 0}
        for s in self.streams:
            out[s.status] += 1
        return out

    def summary(self) -> str:
        lines = [f"{len(self.streams)} streams {self.statuses}; problems "
                 f"{ {k: v for k, v in self.counts.items() if v} }"]
        for s in self.streams:
            for kind, detail in s.problems[:5]:
                lines.append(f"  {s.request_id}: {kind}: {detail}")
        return "\n".join(lines)


def _stream_id(event: SSEEvent, data: dict) -> str | None:
    if event.event == "message_start":
        return data.get("message", {}).get("id")
    if data.get("type") == "response.created":  # the Responses API
        return (data.get("response") or {}).get("id")
    return data.get("id") if isinstance(data.get("id"), str) else None


def check_stream(stream: RecordedStream) -> StreamReport:
    report = StreamReport(stream.request_id, "cut")
    by_index: dict[int, int] = {}
    received: list[int] = []  # every token as it arrived, duplicates and strays included
    max_index = -1
    ended = 0
    final: dict | None = None
    text_parts: list[str] = []

    def problem(kind: str, detail: str) -> None:
        report.problems.append((kind, detail))

    for event in stream.events:
        if event.event == "ping" or event.data.startswith("[DONE]"):
            continue
        try:
            data = json.loads(event.data)
        except ValueError:
            problem("malformed", f"event data is not JSON: {event.data[:80]!r}")
            continue
        if not isinstance(data, dict):
            problem("malformed", f"event data is not an object: {event.data[:80]!r}")
            continue
        if report.request_id is None:
            report.request_id = _stream_id(event, data)
        failed = data.get("type") == "response.failed"  # the Responses API's error end
        if event.event == "error" or failed or "error" in data and data.get("type") != "message":
            if ended:
                problem("ended_twice", "error event after the stream ended")
            ended += 1
            report.status = "failed" if report.status == "cut" else report.status
            report.error = data.get("error")
            if failed:  # {"code", "message"}: the code is the error type the others send
                error = (data.get("response") or {}).get("error") or {}
                report.error = {"type": error.get("code"), "message": error.get("message")}
            continue
        text_parts.append(_text_of(data))
        ext = data.get("tokstream")
        if not isinstance(ext, dict):
            continue
        if ended and ("token_ids" in ext or "digest" in ext):
            problem("after_end", f"event after the end: {event.data[:80]!r}")
        token_ids, indices = ext.get("token_ids") or [], ext.get("indices") or []
        # A merged event names its first token's request; `request_ids` (present only when
        # they differ) names each token's, so a foreign token merged behind the caller's own
        # is still seen as foreign, not as a duplicated or reordered index.
        stamped_ids = ext.get("request_ids")
        if not isinstance(stamped_ids, list) or len(stamped_ids) != len(token_ids):
            stamped_ids = [ext.get("request_id")] * len(token_ids)
        if len(token_ids) != len(indices):
            problem("malformed", f"{len(token_ids)} token ids but {len(indices)} indices")
        if token_ids and event.id is None:
            problem("malformed", "token-carrying event without an id line")
        received.extend(token_ids)
        for token, index, stamped_id in zip(token_ids, indices, stamped_ids):
            if stamped_id is not None and report.request_id is not None \
                    and stamped_id != report.request_id:
                problem("foreign", f"token {token} at index {index} stamped for {stamped_id}")
                continue
            if index in by_index:
                problem("duplicated", f"index {index} again (token {token})")
                continue
            if index < max_index:
                problem("reordered", f"index {index} after index {max_index}")
            by_index[index] = token
            max_index = max(max_index, index)
        if "digest" in ext:
            if ended:
                problem("ended_twice", "a second final event")
            ended += 1
            final = ext
            report.status = "complete" if report.status == "cut" else report.status
            report.finish_reason = ext.get("finish_reason")

    report.token_ids = [by_index[i] for i in sorted(by_index)]
    report.received = received
    report.text = "".join(text_parts)
    expected = final.get("num_output_tokens") if final else None
    top = (expected if expected is not None else max_index + 1)
    missing = [i for i in range(top) if i not in by_index]
    if missing:
        problem("lost", f"{len(missing)} indices missing, first {missing[:5]}")
    if report.status == "cut":
        problem("never_ended", f"no final or error event after {len(stream.events)} events")
    if final is not None:
        if expected is not None and expected != len(received):
            problem("count_mismatch", f"final count {expected}, received {len(received)}")
        if final.get("digest") != token_digest(received):
            problem("digest_mismatch", "the digest of the tokens received, in arrival order, "
                                       "differs from the engine's")
    return report


def _text_of(data: dict) -> str:
    delta = data.get("delta")
    if data.get("type") == "content_block_delta" and isinstance(delta, dict):
        return delta.get("text") or ""
    if data.get("type") == "response.output_text.delta" and isinstance(delta, str):
        return delta
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        if isinstance(choice.get("delta"), dict):
            return choice["delta"].get("content") or ""
        return choice.get("text") or ""
    return ""


def split_choices(stream: RecordedStream) -> list[RecordedStream]:
    """A multi-choice stream as one stream per choice (each named by its engine request id);
    any other stream as itself. An error event ends every choice not yet ended."""
    parsed = [(event, event.json_object()) for event in stream.events]
    seen = [_choice_index(d) for _, d in parsed if d]
    n = stream.num_choices or max((i + 1 for i in seen if i is not None), default=1)
    if n <= 1:
        return [stream]
    response_id = stream.request_id or next(
        (_stream_id(e, d) for e, d in parsed if d and _stream_id(e, d)), None)
    choices = [RecordedStream([], choice_request_id(response_id, i) if response_id else None)
               for i in range(min(n, MAX_RESPONSE_CHOICES))]
    ended = set()
    for event, data in parsed:
        if data is None:
            if not event.data.startswith("[DONE]"):
                for choice in choices:
                    choice.events.append(event)  # malformed: every choice reports it
            continue
        if event.event == "error" or "error" in data and data.get("type") != "message":
            for i, choice in enumerate(choices):
                if i not in ended:
                    choice.events.append(event)
            continue
        index = _choice_index(data)
        if index is None or not 0 <= index < len(choices):
            continue  # the usage chunk (no choice) or a choice past n
        choices[index].events.append(event)
        if "digest" in (data.get("tokstream") or {}):
            ended.add(index)  # an error after this belongs to the choices still running
    return choices


def _choice_index(data: dict) -> int | None:
    """The choice an event belongs to, as the caller sees it (`choices[0].index`)."""
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        index = choices[0].get("index")
        return index if isinstance(index, int) else None
    return None


def check_streams(streams: list[RecordedStream]) -> CheckReport:
    """Check each stream (each choice of a multi-choice one), then across streams: no
    (request, index) delivered to two callers."""
    reports = [check_stream(c) for s in streams for c in split_choices(s)]
    owners: dict[str, int] = {}
    for n, report in enumerate(reports):
        if report.request_id is None:
            continue
        if report.request_id in owners:
            report.problems.append(("foreign", f"request id {report.request_id} also streamed "
                                               f"to caller {owners[report.request_id]}"))
        owners[report.request_id] = n
    return CheckReport(reports)
