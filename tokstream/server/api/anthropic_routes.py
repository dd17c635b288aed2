"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API."""

from __future__ import annotations

import uuid
from typing import Callable

from starlette.responses import JSONResponse

from tokstream.engine.messages.request import FinishReason
from tokstream.errors import UserInputError
from tokstream.server.api.anthropic_output import output_sampling
from tokstream.server.api.anthropic_threads import (conversation_size, keep_reply, thread_of,
                                                    with_thread)
from tokstream.server.api.conversation_store import owner_of
from tokstream.server.tool_calls.anthropic_tools import (ToolBlocks, content_blocks, history_messages,
                                                  tool_request, tool_stop_reason)
from tokstream.server.api.api_request import chat_turns, read_request
from tokstream.server.streaming.channel import DeltaBatch
from tokstream.server.api_errors import ANTHROPIC, ApiError, api_route, bad_request
from tokstream.server.streaming.responses import collect
from tokstream.server.api.sampling_options import bounded_options
from tokstream.server.streaming.sse import (EventStreamResponse, final_integrity, integrity, sse,
                                            stream_failure, wants_integrity)
from tokstream.server.server import Prompt, Server
from tokstream.server.streaming.streams import Stream
from tokstream.server.tool_calls.tool_template import encode_chat, encode_continuation
from tokstream.server.tool_calls.tools import Tool, ToolRequest, tool_sampling
from tokstream.server.validation import (_kind, check_fits, get_bool, get_int, get_messages,
                                         get_object, get_strings, parse_off_loop,
                                         reject_unsupported, sampling_params, shown)

ROLES = ("user", "assistant")


def _text_blocks(value, path: str, allow_empty: bool = False) -> str:
    """A string, or a list of {"type": "text", "text": ...} blocks, as one string."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        parts = []
        for n, block in enumerate(value):
            at = f"{path}.{n}"
            if not isinstance(block, dict):
                raise bad_request(at, f"must be a content block object, not {_kind(block)}")
            kind = block.get("type")
            if kind != "text":
                raise bad_request(f"{at}.type", f"only 'text' blocks are supported, got "
                                                f"{shown(kind)}")
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text", "must be a string")
            parts.append(block["text"])
        text = "".join(parts)
        if not value and not allow_empty:
            raise bad_request(path, "must not be an empty list")
    else:
        raise bad_request(path, f"must be a string or an array of text blocks, not "
                                f"{_kind(value)}")
    if not text and not allow_empty:
        raise bad_request(path, "must not be empty")
    return text


THINKING_BLOCKS = {"thinking": "thinking", "redacted_thinking": "data"}
"""An earlier assistant turn's reasoning (block type -> its required string field), as a
reasoning model's transcript replays it."""


def _without_thinking(blocks: list, at: str) -> list:
    """An assistant turn's blocks less its thinking blocks, which the Messages API drops from
    earlier turns (a model that does not reason has none to continue)."""
    kept = []
    for n, block in enumerate(blocks):
        field = THINKING_BLOCKS.get(block.get("type")) if isinstance(block, dict) else None
        if field is None:
            kept.append(block)
        elif not isinstance(block.get(field), str):
            raise bad_request(f"{at}.{n}.{field}", "must be a string")
    return kept


def chat_messages(body: dict) -> list[dict]:
    messages = get_messages(body)
    chat = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system", allow_empty=True)
        if text:
            chat.append({"role": "system", "content": text})
    for at, message, role in chat_turns(messages, ROLES, "'user' or 'assistant'"):
        if "content" not in message:
            raise bad_request(f"{at}.content", "required")
        content = message["content"]
        thought = role == "assistant" and isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in THINKING_BLOCKS for b in content)
        if thought:
            content = _without_thinking(content, f"{at}.content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in (
                "tool_use", "tool_result") for b in content):
            chat += history_messages(role, content, f"{at}.content")
        else:
            chat.append({"role": role, "content": _text_blocks(content, f"{at}.content",
                                                               allow_empty=thought)})
    if chat[-1]["role"] == "assistant" and len(chat) == 1:
        raise bad_request("messages.0.role", "the first message must be from the user")
    return chat


def encode_messages(server: Server, chat: list[dict], tools: tuple[Tool, ...] = (),
                    limit: int | None = None) -> list[int]:
    """Prompt ids, with the tools shown to the model; a final assistant message is a prefill
    the model continues. limit: tool_template.encode_chat's."""
    tokenizer = server.tokenizer
    try:
        if chat[-1]["role"] == "assistant":
            return encode_continuation(tokenizer, chat, tools, limit=limit)
        return encode_chat(tokenizer, chat, tools, limit=limit)
    except UserInputError as error:
        raise bad_request("messages", str(error)) from None


def parse(body: dict, server: Server) -> Prompt:
    server.check_model(body.get("model"))
    max_tokens = get_int(body, "max_tokens", required=True, minimum=1)
    # What the API would do on the caller's behalf (extended thinking, tools from remote MCP
    # servers, a code-execution container): answering without it would be another answer.
    reject_unsupported(body, {"thinking": lambda v: not (isinstance(v, dict)
                                                         and v.get("type") == "disabled"),
                              "mcp_servers": bool, "container": lambda v: True})
    get_object(body, "metadata")
    options = bounded_options(body, "anthropic")
    stop = get_strings(body, "stop_sequences", allow_single=False)
    ignore_eos = get_bool(body, "ignore_eos")
    stream = get_bool(body, "stream")
    tools = tool_request(body)
    output = output_sampling(body)
    chat = chat_messages(body)
    if output and chat[-1]["role"] == "assistant":
        # The grammar holds the whole output to the schema, and a prefill is its start.
        raise bad_request(f"messages.{len(body['messages']) - 1}", "a final assistant message "
                          "(a prefill) cannot be combined with an output format")
    output.update(tool_sampling(tools, output.get("structured")))
    token_ids = encode_messages(server, chat, tools.tools if tools else (),
                                limit=server.max_model_len)
    check_fits(len(token_ids), max_tokens, server.max_model_len, "messages")
    params = sampling_params({"stop": "stop_sequences", "structured": "output_config.format"},
                             max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos,
                             **options, **output)
    return Prompt(token_ids, params, stream, tools=tools)


def stop_reason(stream: Stream) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished stream."""
    final = stream.final
    if final.finish_reason == FinishReason.STOP:
        if isinstance(final.stop_reason, str):
            return "stop_sequence", final.stop_reason
        return "end_turn", None
    if final.stop_reason == "kv_cache_capacity" or \
            final.num_output_tokens < stream.params.max_tokens:
        return "model_context_window_exceeded", None
    return "max_tokens", None


def usage(stream: Stream, block_size: int) -> dict:
    """The Messages API's usage: prompt tokens read from the prefix cache, those this request
    wrote to it (its prompt's full blocks past the cached part: caching is automatic, and
    cache_control is accepted and changes nothing), and the rest."""
    final = stream.final
    prompt, cached = final.num_prompt_tokens, final.num_cached_tokens
    created = max(0, prompt // block_size * block_size - cached)
    return {"input_tokens": prompt - cached - created, "output_tokens": final.num_output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": created}


class AnthropicFormatter:
    def __init__(self, stream: Stream, model: str, integrity: bool = True,
                 block_size: int = 16, tools: ToolRequest | None = None,
                 on_done: Callable[[list[dict]], None] | None = None):
        self.on_done = on_done
        """Called with the finished message's content blocks (to keep a thread's reply)."""
        self.sent: list[tuple[str, dict]] = []
        """With on_done: the content events sent so far, the content rebuilt from them."""
        self.integrity = integrity
        self.block_size = block_size
        """id: lines on token events (the integrity framing); off: the Messages API's own."""
        self.stream = stream
        self.model = model
        self.tool_blocks = ToolBlocks(tools) if tools is not None else None
        """Splits the text into text and tool_use blocks (a request with tools)."""
        self.unsent = DeltaBatch()
        """Tokens whose text the parser holds back, carried by the next event."""

    def start(self) -> bytes:
        message = {"id": self.stream.request_id, "type": "message", "role": "assistant",
                   "content": [], "model": self.model, "stop_reason": None,
                   "stop_sequence": None,
                   "usage": {"input_tokens": self.stream.num_prompt_tokens, "output_tokens": 0}}
        head = sse("message_start", {"type": "message_start", "message": message})
        if self.tool_blocks is None:  # with tools, blocks open as the parser finds them
            head += sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
        return head + self.ping()

    def tokens(self, batch: DeltaBatch) -> bytes:
        if self.tool_blocks is not None:
            self.unsent.merge(batch)
            return self._carrying(self._record(self.tool_blocks.feed(batch.text)))
        data = {"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": batch.text}}
        self._record([("content_block_delta", data)])
        if batch.token_ids:
            data["tokstream"] = integrity(batch)
            return sse("content_block_delta", data,
                       batch.indices[-1] if self.integrity else None)
        return sse("content_block_delta", data)

    def finish(self, batch: DeltaBatch) -> bytes:
        failure = stream_failure(self.stream)
        if failure is not None:
            return self.error(*failure)
        reason, sequence = stop_reason(self.stream)
        if self.tool_blocks is None:
            body = sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        else:
            body = self._carrying(self._record(self.tool_blocks.finish()))
            reason, sequence = tool_stop_reason(reason, sequence, self.tool_blocks.made_calls)
        if self.on_done is not None:
            start = [] if self.tool_blocks is not None else [("content_block_start", {
                "content_block": {"type": "text", "text": ""}})]
            self.on_done(content_blocks(start + self.sent))
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage(self.stream, self.block_size),
                 "tokstream": final_integrity(self.stream)}
        return (body + self._carrying([("message_delta", delta)])
                + sse("message_stop", {"type": "message_stop"}))

    def _record(self, events: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
        if self.on_done is not None:
            self.sent += events
        return events

    def _carrying(self, events: list[tuple[str, dict]]) -> bytes:
        """The events, the last carrying the tokens not yet sent (so every token rides on
        the first event its text reaches, or on the final one)."""
        if not events:
            return b""
        body = b"".join(sse(name, data) for name, data in events[:-1])
        name, data = events[-1]
        if not self.unsent.token_ids:
            return body + sse(name, data)
        carried, self.unsent = self.unsent, DeltaBatch()
        data = {**data, "tokstream": {**integrity(carried), **data.get("tokstream", {})}}
        return body + sse(name, data, carried.indices[-1] if self.integrity else None)

    def error(self, error_type: str, message: str) -> bytes:
        return sse("error", {"type": "error", "error": {"type": error_type, "message": message}})

    def ping(self) -> bytes:
        return sse("ping", {"type": "ping"})


def message_body(stream: Stream, batch: DeltaBatch, model: str, block_size: int,
                 tools: ToolRequest | None = None) -> dict:
    reason, sequence = stop_reason(stream)
    content = [{"type": "text", "text": batch.text}]
    if tools is not None:
        blocks = ToolBlocks(tools)
        content = content_blocks(blocks.feed(batch.text) + blocks.finish())
        reason, sequence = tool_stop_reason(reason, sequence, blocks.made_calls)
    return {"id": stream.request_id, "type": "message", "role": "assistant", "model": model,
            "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(stream, block_size),
            "tokstream": {**final_integrity(stream), "token_ids": batch.token_ids}}


@api_route(ANTHROPIC)
async def create_message(request):
    server, tenant, body = await read_request(request)
    owner = owner_of(tenant)

    def read(body: dict) -> tuple[dict, Prompt, int]:  # off the loop, long threads included
        body = with_thread(body, server.conversations, owner)
        return body, parse(body, server), conversation_size(body) if thread_of(body) else 0

    body, prompt, size = await parse_off_loop(request, read, body)
    request_id = f"msg_{uuid.uuid4().hex[:24]}"
    stream = server.submit(request_id, prompt, tenant, ANTHROPIC)
    headers = {"request-id": request_id}

    def keep(content: list[dict]) -> None:
        keep_reply(server.conversations, owner, body, size, request_id, content)

    if prompt.stream:
        formatter = AnthropicFormatter(stream, body["model"], wants_integrity(
            request.headers, server.config.stream_integrity), server.block_size, prompt.tools,
            on_done=keep if thread_of(body) else None)
        return EventStreamResponse(stream, formatter,
                                   server.registry, server.config.ping_interval_s, headers)
    batch = await collect(stream, request.receive, server.registry)
    failure = stream_failure(stream)
    if failure is not None:
        raise ApiError(*failure, retry_after=5 if failure[0] == "overloaded_error" else None)
    message = message_body(stream, batch, body["model"], server.block_size, prompt.tools)
    keep(message["content"])
    return JSONResponse(message, headers=headers)


@api_route(ANTHROPIC)
async def count_tokens(request):
    server, tenant, body = await read_request(request)
    server.check_model(body.get("model"))

    def count():  # the tools' schemas compile too (tool_request): off the loop with the rest
        whole = with_thread(body, server.conversations, owner_of(tenant))  # a continue's all
        tools = tool_request(whole)
        return encode_messages(server, chat_messages(whole), tools.tools if tools else ())

    token_ids = await parse_off_loop(request, count)
    if tenant is not None:
        tenant.charge(len(token_ids))  # counting costs tokenisation: it is not free
    return JSONResponse({"input_tokens": len(token_ids)})
