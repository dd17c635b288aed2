"""A Responses API answer: the output items (an assistant `message` holding one `output_text`
part, and a `function_call` item per call the model makes), streamed as the API's semantic
events or returned in one response object.

Streamed, a response is `response.created` and `response.in_progress`, then for each item
`response.output_item.added`, its deltas (`response.output_text.delta`, or
`response.function_call_arguments.delta`), its `.done` events and
`response.output_item.done`, and last `response.completed` (`response.incomplete` when
max_output_tokens cut it, `response.failed` when it failed). Every event has the next
`sequence_number`. As on the other routes, each token rides on the first event its text
reaches (or on the final event), with an `id:` line and a `tokstream` key (sse.integrity), so
the integrity checker reads these streams as it reads the others."""

from __future__ import annotations

import copy
import uuid
from typing import Callable

from tokstream.engine.messages.request import FinishReason
from tokstream.server.api.content_logprobs import ContentLogprobs
from tokstream.server.tool_calls.tool_parser import (ArgumentsPiece, CallEnd, CallStart, HermesParser,
                                              TextPiece)
from tokstream.server.tool_calls.tools import ToolRequest, new_call_id
from tokstream.server.streaming.channel import DeltaBatch
from tokstream.server.streaming.sse import final_integrity, integrity, sse, stream_failure
from tokstream.server.streaming.streams import Stream

MESSAGE_ID_PREFIX, CALL_ITEM_PREFIX, CALL_ID_PREFIX = "msg_", "fc_", "call_"


def item_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class ResponseItems:
    """One response's output items, built from the model's text as it streams: the events
    that announce, extend and close each item, and the items themselves (`output`)."""

    def __init__(self, tools: ToolRequest | None):
        self.parser = HermesParser(max_calls=None if tools.parallel else 1) \
            if tools is not None else None
        """Splits text and calls (a request with tools); without tools all text is text."""
        self.output: list[dict] = []
        """Every item so far, the last one still being written while `open` is set (its text
        or arguments as of the last current_output())."""
        self.open = False
        self.pieces: list[str] = []
        """The open item's text or arguments so far, joined when it closes (a long output
        appended to one string would be copied whole at every token)."""

    def current_output(self) -> list[dict]:
        """Every item so far, the open one holding all its text yet."""
        if self.open:
            item, text = self.output[-1], "".join(self.pieces)
            if item["type"] == "message":
                item["content"][0]["text"] = text
            else:
                item["arguments"] = text
        return self.output

    def feed(self, text: str) -> list[dict]:
        pieces = self.parser.feed(text) if self.parser else [TextPiece(text)] if text else []
        return [event for piece in pieces for event in self._events(piece)]

    def finish(self, status: str) -> list[dict]:
        """The events that end the output: the parser's held-back text, the open item closed
        with status (completed, or incomplete when the output was cut), and an empty message
        when the model wrote nothing at all."""
        events = [e for piece in (self.parser.finish() if self.parser else [])
                  for e in self._events(piece)]
        if not self.output:
            events += self._open_message()
        return events + self._close(status)

    def add_logprobs(self, entries: list[dict]) -> None:
        """Token logprobs of text just streamed into the open message."""
        if self.open and self.output[-1]["type"] == "message":
            self.output[-1]["content"][0]["logprobs"] += entries

    def _events(self, piece) -> list[dict]:
        match piece:
            case TextPiece(text=text):
                out = [] if self.open and self.output[-1]["type"] == "message" \
                    else self._close("completed") + self._open_message()
                self.pieces.append(text)
                return out + [{"type": "response.output_text.delta", **self._where(),
                               "content_index": 0, "delta": text, "logprobs": []}]
            case CallStart(name=name):
                return self._close("completed") + self._open({
                    "id": item_id(CALL_ITEM_PREFIX), "type": "function_call",
                    "status": "in_progress", "call_id": new_call_id(CALL_ID_PREFIX),
                    "name": name, "arguments": ""})
            case ArgumentsPiece(text=text):
                self.pieces.append(text)
                return [{"type": "response.function_call_arguments.delta", **self._where(),
                         "delta": text}]
            case CallEnd():
                return self._close("completed")
        return []

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open_message(self) -> list[dict]:
        events = self._open({"id": item_id(MESSAGE_ID_PREFIX), "type": "message",
                             "status": "in_progress", "role": "assistant", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output[-1]["content"].append(part)
        return events + [{"type": "response.content_part.added", **self._where(),
                          "content_index": 0, "part": copy.deepcopy(part)}]

    def _open(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = True
        self.pieces = []
        return [{"type": "response.output_item.added", "output_index": len(self.output) - 1,
                 "item": copy.deepcopy(item)}]

    def _close(self, status: str) -> list[dict]:
        if not self.open:
            return []
        self.current_output()
        self.open = False
        item = self.output[-1]
        item["status"] = status
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", **where, "content_index": 0,
                       "text": part["text"], "logprobs": part["logprobs"]},
                      {"type": "response.content_part.done", **where, "content_index": 0,
                       "part": part}]
        else:
            events = [{"type": "response.function_call_arguments.done", **where,
                       "name": item["name"], "arguments": item["arguments"]}]
        return [copy.deepcopy(e) for e in events] + [{
            "type": "response.output_item.done", "output_index": where["output_index"],
            "item": copy.deepcopy(item)}]


def usage(stream: Stream) -> dict:
    final = stream.final
    return {"input_tokens": final.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": final.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.num_prompt_tokens + final.num_output_tokens}


def status(stream: Stream) -> str:
    """completed, or incomplete when max_output_tokens (or the context) cut the output."""
    return "completed" if stream.final.finish_reason == FinishReason.STOP else "incomplete"


def response_object(stream: Stream, model: str, fields: dict, state: str, output: list[dict],
                    error: dict | None = None) -> dict:
    """The response as the API returns it (and as its lifecycle events carry it)."""
    done = state in ("completed", "incomplete")
    return {"id": stream.request_id, "object": "response", "created_at": int(stream.created),
            "status": state, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if state == "incomplete"
            else None,
            "model": model, "output": copy.deepcopy(output),
            "usage": usage(stream) if done else None, **fields}


class ResponseFormatter:
    """A streamed response's events (a StreamFormatter for sse.EventStreamResponse)."""

    def __init__(self, stream: Stream, model: str, fields: dict, tokenizer, logprobs: bool,
                 integrity: bool = True, tools: ToolRequest | None = None,
                 on_done: Callable[[dict], None] | None = None):
        self.stream = stream
        self.on_done = on_done
        """Called with the finished response (completed or incomplete), to store it."""
        self.model = model
        self.fields = fields
        """The request's settings, repeated in every response object sent."""
        self.items = ResponseItems(tools)
        self.integrity = integrity
        """id: lines and comment pings (the integrity framing); off: the API's own framing."""
        self.content_logprobs = ContentLogprobs(tokenizer) if logprobs else None
        self.unsent = DeltaBatch()
        """Tokens whose text the parser holds back, carried by the next event."""
        self.sequence = 0

    def _sse(self, events: list[dict], batch: DeltaBatch | None = None) -> bytes:
        """The events numbered in order, the last carrying batch's tokens when it has any."""
        body = b""
        for n, event in enumerate(events):
            event["sequence_number"] = self.sequence
            self.sequence += 1
            event_id = None
            if batch is not None and batch.token_ids and n == len(events) - 1:
                event["tokstream"] = {**integrity(batch), **event.get("tokstream", {})}
                event_id = batch.indices[-1] if self.integrity else None
            body += sse(event["type"], event, event_id)
        return body

    def _response(self, state: str, error: dict | None = None) -> dict:
        return response_object(self.stream, self.model, self.fields, state,
                               self.items.current_output(), error)

    def start(self) -> bytes:
        head = self._response("in_progress")
        return self._sse([{"type": "response.created", "response": head},
                          {"type": "response.in_progress", "response": head}])

    def tokens(self, batch: DeltaBatch) -> bytes:
        events = self.items.feed(batch.text)
        if self.unsent.token_ids or not events:  # tokens held back ride with these
            self.unsent.merge(batch)
            if not events:
                return b""
            batch, self.unsent = self.unsent, DeltaBatch()
        carried = batch
        if self.content_logprobs is not None and carried.token_ids:
            entries = self.content_logprobs.feed(carried.token_ids, carried.logprobs,
                                                 carried.text)
            if events[-1]["type"] == "response.output_text.delta":
                events[-1]["logprobs"] = entries
                self.items.add_logprobs(entries)
        return self._sse(events, carried)

    def finish(self, batch: DeltaBatch) -> bytes:
        failure = stream_failure(self.stream)
        if failure is not None:
            return self.error(*failure)
        state = status(self.stream)
        if self.content_logprobs is not None:  # what the parser held back, then the rest
            self.items.add_logprobs(self.content_logprobs.feed(
                self.unsent.token_ids, self.unsent.logprobs, self.unsent.text)
                + self.content_logprobs.finish())
        events = self.items.finish(state)
        response = self._response(state)
        if self.on_done is not None:
            self.on_done(response)
        last = {"type": f"response.{state}", "response": response,
                "tokstream": final_integrity(self.stream)}
        carried, self.unsent = self.unsent, DeltaBatch()
        return self._sse(events) + self._sse([last], carried)

    def error(self, error_type: str, message: str) -> bytes:
        failed = self._response("failed", {"code": error_type, "message": message})
        return self._sse([{"type": "response.failed", "response": failed}])

    def ping(self) -> bytes:
        # A comment line, as on the chat route (see OpenAIFormatter.ping).
        return b": ping\n" if self.integrity else b""


def response_body(stream: Stream, batch: DeltaBatch, model: str, fields: dict, tokenizer,
                  logprobs: bool, tools: ToolRequest | None = None) -> dict:
    """The finished response of a request that did not stream."""
    items = ResponseItems(tools)
    state = status(stream)
    items.feed(batch.text)
    items.finish(state)
    if logprobs:
        content = ContentLogprobs(tokenizer)
        entries = content.feed(batch.token_ids, batch.logprobs, batch.text) + content.finish()
        message = next((i for i in items.output if i["type"] == "message"), None)
        if message is not None:
            message["content"][0]["logprobs"] = entries
    body = response_object(stream, model, fields, state, items.output)
    body["tokstream"] = {**final_integrity(stream), "token_ids": batch.token_ids}
    return body
