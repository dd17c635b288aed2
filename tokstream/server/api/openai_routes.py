"""POST /v1/chat/completions and /v1/completions: the OpenAI-compatible API.

The body is read in tokstream/server/api/openai_request.py; here the answer is written, streamed
chunk by chunk or as one JSON body."""

from __future__ import annotations

import time
import uuid

from starlette.responses import JSONResponse

from tokstream.engine.messages.request import FinishReason
from tokstream.server.api.api_request import read_request
from tokstream.server.streaming.channel import DeltaBatch
from tokstream.server.api.choices import Choice, choices_response, collect_choices, merge_bodies
from tokstream.server.api_errors import OPENAI, ApiError, api_route
from tokstream.server.api.content_logprobs import ContentLogprobs
from tokstream.server.api.echo import Echo, echoed, prompt_logprobs_field
from tokstream.server.api.logprobs_format import completion_logprobs
from tokstream.server.api.openai_request import parse
from tokstream.server.tool_calls.openai_tools import (ToolDeltas, finish_reason as tool_finish_reason,
                                               tool_message)
from tokstream.server.streaming.sse import (final_integrity, integrity, sse, stream_failure,
                                            wants_integrity)
from tokstream.server.streaming.streams import Stream
from tokstream.server.tool_calls.tools import ToolRequest
from tokstream.server.validation import parse_off_loop


def finish_reason(stream: Stream) -> str:
    return "stop" if stream.final.finish_reason == FinishReason.STOP else "length"


def usage(stream: Stream) -> dict:
    final = stream.final
    return {"prompt_tokens": final.num_prompt_tokens,
            "completion_tokens": final.num_output_tokens,
            "total_tokens": final.num_prompt_tokens + final.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens}}


def batch_logprobs(stream: Stream, batch: DeltaBatch, chat: bool, tokenizer, text_offset: int = 0):
    """A whole choice's `logprobs` (None when the request did not ask)."""
    if stream.params.logprobs is None:
        return None
    if chat:
        content = ContentLogprobs(tokenizer)
        entries = content.feed(batch.token_ids, batch.logprobs, batch.text) + content.finish()
        return {"content": entries, "refusal": None}
    return completion_logprobs(tokenizer, batch.token_ids, batch.logprobs, text_offset)


class OpenAIFormatter:
    def __init__(self, stream: Stream, model: str, chat: bool, include_usage: bool,
                 tokenizer=None, integrity: bool = True, tools: ToolRequest | None = None,
                 choice: Choice | None = None, echo: Echo | None = None,
                 continuous_usage: bool = False):
        self.stream = stream
        self.continuous_usage = continuous_usage
        """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
        self.completion_tokens = 0
        """Output tokens streamed so far."""
        self.echo = echo
        """Completions: the prompt to show before the output, in the first chunk with tokens
        (set to None once shown)."""
        self.choice = choice or Choice(stream.request_id)
        """The choice this writes (its index; the response's id, shared by every choice)."""
        self.tool_deltas = ToolDeltas(tools) if tools is not None else None
        """Splits the text into content and tool_calls deltas (a request with tools)."""
        self.integrity = integrity
        """id: lines and comment pings (the integrity framing); off: OpenAI's own framing."""
        self.tokenizer = tokenizer
        self.content_logprobs = ContentLogprobs(tokenizer) \
            if chat and stream.params.logprobs is not None else None
        """Chat logprobs, listed as the text they stand for is streamed."""
        self.text_offset = 0
        """Characters streamed so far (completions' logprobs.text_offset)."""
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, text: str | None, finish: str | None = None, role: bool = False,
               delta: dict | None = None) -> dict:
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": self.choice.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": self.choice.index, "text": text or "", "logprobs": None, "finish_reason": finish}
        chunk = {"id": self.choice.response_id, "object": self.object,
                 "created": self.created, "model": self.model, "choices": [choice]}
        if self.continuous_usage:
            prompt, output = self.stream.num_prompt_tokens, self.completion_tokens
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": output,
                              "total_tokens": prompt + output}
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> bytes:
        return sse(None, self._chunk("", role=True)) if self.chat else b""

    def tokens(self, batch: DeltaBatch) -> bytes:
        self.completion_tokens += len(batch.token_ids)
        if self.tool_deltas is not None:
            return self._tool_chunks(self.tool_deltas.feed(batch.text), batch)
        if self.echo is not None and batch.token_ids:
            return self._echo_chunk(batch)
        chunk = self._chunk(batch.text)
        if batch.token_ids and self.stream.params.logprobs is not None:
            chunk["choices"][0]["logprobs"] = self._logprobs(batch)
        self.text_offset += len(batch.text)
        if batch.token_ids:
            chunk["tokstream"] = integrity(batch)
            return sse(None, chunk, batch.indices[-1] if self.integrity else None)
        return sse(None, chunk)

    def _echo_chunk(self, batch: DeltaBatch) -> bytes:
        """The first chunk with tokens of an echoing completion: the prompt, then the output
        (none for a prompt_only echo)."""
        echo, params = self.echo, self.stream.params
        text, logprobs = echoed(echo, self.tokenizer, self.stream.prompt_token_ids,
                                params.logprobs, batch.prompt_logprobs, batch.token_ids,
                                batch.logprobs, batch.text)
        self.echo = None  # a prompt_only echo samples one token: this batch holds it
        chunk = self._chunk(text)
        chunk["choices"][0]["logprobs"] = logprobs
        self.text_offset += len(text)
        chunk["tokstream"] = integrity(batch)
        return sse(None, chunk, batch.indices[-1] if self.integrity else None)

    def _tool_chunks(self, deltas: list[dict], batch: DeltaBatch | None) -> bytes:
        """A chunk per delta; the last carries the batch's tokens (with an empty delta when
        the parser holds back all their text)."""
        chunks = [self._chunk(None, delta=d) for d in deltas]
        if batch is None or not batch.token_ids:
            return b"".join(sse(None, c) for c in chunks)
        if not chunks:
            chunks.append(self._chunk(None))
        last = chunks[-1]
        last["choices"][0]["logprobs"] = self._logprobs(batch)
        last["tokstream"] = integrity(batch)
        return b"".join(sse(None, c) for c in chunks[:-1]) + sse(
            None, last, batch.indices[-1] if self.integrity else None)

    def finish(self, batch: DeltaBatch) -> bytes:
        failure = stream_failure(self.stream)
        if failure is not None:
            return self.error(*failure)
        reason, body = finish_reason(self.stream), b""
        self.completion_tokens = self.stream.final.num_output_tokens
        if self.tool_deltas is not None:
            body = self._tool_chunks(self.tool_deltas.finish(), None)
            reason = tool_finish_reason(reason, self.tool_deltas.made_calls)
        chunk = self._chunk(None if self.chat else "", reason)
        if self.content_logprobs is not None:
            chunk["choices"][0]["logprobs"] = {"content": self.content_logprobs.finish(),
                                               "refusal": None}
        chunk["choices"][0]["stop_reason"] = self.stream.final.stop_reason
        chunk["tokstream"] = final_integrity(self.stream)
        body += sse(None, chunk)
        if self.choice.count > 1:
            return body  # the usage chunk and [DONE] follow the last choice (server/api/choices.py)
        if self.include_usage:
            body += sse(None, {"id": self.stream.request_id, "object": self.object,
                               "created": self.created, "model": self.model, "choices": [],
                               "usage": usage(self.stream)})
        return body + b"data: [DONE]\n\n"

    def _logprobs(self, batch: DeltaBatch) -> dict | None:
        """These tokens' logprobs (chat: the entries whose text has now been streamed)."""
        if self.content_logprobs is None:
            return batch_logprobs(self.stream, batch, self.chat, self.tokenizer,
                                  self.text_offset)
        return {"content": self.content_logprobs.feed(batch.token_ids, batch.logprobs,
                                                      batch.text), "refusal": None}

    def error(self, error_type: str, message: str) -> bytes:
        return sse(None, {"error": {"message": message, "type": error_type, "param": None,
                                    "code": None}}) + b"data: [DONE]\n\n"

    def ping(self) -> bytes:
        # A comment line with no blank line after it: a blank line would make the official
        # SDK's decoder (which keeps the last event id) emit an empty event it cannot parse.
        # OpenAI sends no keep-alives, and some stock parsers take a comment for data.
        return b": ping\n" if self.integrity else b""


def response_body(stream: Stream, batch: DeltaBatch, model: str, chat: bool, tokenizer,
                  tools: ToolRequest | None = None, echo: Echo | None = None) -> dict:
    reason = finish_reason(stream)
    logprobs = batch_logprobs(stream, batch, chat, tokenizer)
    message = {"role": "assistant", "content": batch.text}
    if tools is not None:
        message = tool_message(batch.text, tools)
        reason = tool_finish_reason(reason, "tool_calls" in message)
    if chat:
        choice = {"index": 0, "message": message,
                  "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": stream.final.stop_reason}
    else:
        text, params = batch.text, stream.params
        if echo is not None:
            text, logprobs = echoed(echo, tokenizer, stream.prompt_token_ids, params.logprobs,
                                    batch.prompt_logprobs, batch.token_ids, batch.logprobs,
                                    batch.text)
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": stream.final.stop_reason}
        if params.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(
                tokenizer, stream.prompt_token_ids, batch.prompt_logprobs)
    return {"id": stream.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(stream.created), "model": model, "choices": [choice],
            "usage": usage(stream),
            "tokstream": {**final_integrity(stream), "token_ids": batch.token_ids}}


async def _complete(request, chat: bool):
    server, tenant, body = await read_request(request)
    prompts = await parse_off_loop(request, parse, body, server, chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    streams = server.submit_choices(request_id, prompts, tenant, OPENAI)
    first, n = prompts[0], prompts[0].n
    headers = {"x-request-id": request_id}
    if first.stream:
        options = body.get("stream_options") or {}
        integrity = wants_integrity(request.headers, server.config.stream_integrity)
        formatters = [OpenAIFormatter(stream, body["model"], chat,
                                      bool(options.get("include_usage")), server.tokenizer,
                                      integrity, first.tools,
                                      Choice(request_id, index, len(streams)),
                                      prompts[index // n].echo,
                                      bool(options.get("continuous_usage_stats")))
                      for index, stream in enumerate(streams)]
        return choices_response(streams, formatters, usage, server.registry,
                                server.config.ping_interval_s, headers, n)
    batches = await collect_choices(streams, request.receive, server.registry)
    failure = next(filter(None, map(stream_failure, streams)), None)
    if failure is not None:
        raise ApiError(*failure, retry_after=5 if failure[0] == "overloaded_error" else None)
    return JSONResponse(merge_bodies([
        response_body(stream, batch, body["model"], chat, server.tokenizer, first.tools,
                      prompts[index // n].echo)
        for index, (stream, batch) in enumerate(zip(streams, batches))], n), headers=headers)


@api_route(OPENAI)
async def chat_completions(request):
    return await _complete(request, chat=True)


@api_route(OPENAI)
async def completions(request):
    return await _complete(request, chat=False)

