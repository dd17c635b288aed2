"""Constrained generations for tests/test_tools_api.py and bench/tool_calls_bench.py: forced
tool calls on both APIs (OpenAI `required` / a named function, Anthropic `any` / `tool`),
OpenAI `response_format` JSON schemas and (on request) Anthropic `output_config.format`, over
varied schemas, seeds and temperatures; what each streamed back, read from its recorded SSE
events; and the check that it is valid."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import jsonschema

from helpers.serving import INTEGRITY
from tokstream.checker import RecordedStream, SSERecorder

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                      "unit": {"enum": ["c", "f"]}},
     "required": ["city", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}},
     "required": ["n", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": "string", "maxLength": 5}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"},
                                      "note": {"type": "string", "maxLength": 4}},
     "required": ["flag"], "additionalProperties": False},
]
NAMES = ["get_weather", "count", "tag_it", "place", "set_flag"]
KINDS = ("openai_tool", "anthropic_tool", "response_format")
"""What jobs() makes by default (the mix bench/tool_calls_bench.py's results were measured on)."""
ALL_KINDS = (*KINDS, "output_format")


@dataclass
class Job:
    kind: str
    """One of KINDS."""
    route: str
    body: dict
    schemas: dict
    """Function name -> what its call's arguments must match ({"": schema} for the
    response's content)."""
    name: str | None
    """The function a forced call must name (None: any of the request's tools)."""


def jobs(count: int, model: str = "dummy:tiny", max_tokens: int = 256,
         kinds: tuple[str, ...] = KINDS) -> list[Job]:
    """count constrained requests, varied by schema, API, tool_choice, seed and temperature."""
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        s = (i // 3) % len(SCHEMAS)
        schema, name = SCHEMAS[s], NAMES[s]
        other = (s + 1) % len(SCHEMAS)
        named = (i // 15) % 2 == 0
        common = {"model": model, "max_tokens": max_tokens, "stream": True, "seed": i,
                  "messages": [{"role": "user", "content": f"Request {i}: use a tool."}]}
        offered = {NAMES[k]: SCHEMAS[k] for k in (s, other)}
        if kind == "openai_tool":
            tools = [{"type": "function", "function": {"name": NAMES[k], "parameters": SCHEMAS[k]}}
                     for k in (s, other)]
            choice = {"type": "function", "function": {"name": name}} if named else "required"
            body = {**common, "temperature": (0.0, 0.6, 1.0, 1.5)[i % 4], "tools": tools,
                    "tool_choice": choice, "parallel_tool_calls": False}
            out.append(Job(kind, "/v1/chat/completions", body, offered, name if named else None))
        elif kind == "anthropic_tool":
            tools = [{"name": NAMES[k], "input_schema": SCHEMAS[k]} for k in (s, other)]
            choice = ({"type": "tool", "name": name} if named
                      else {"type": "any", "disable_parallel_tool_use": True})
            body = {**common, "temperature": (0.0, 0.5, 0.8, 1.0)[i % 4], "tools": tools,
                    "tool_choice": choice}
            out.append(Job(kind, "/v1/messages", body, offered, name if named else None))
        elif kind == "response_format":
            body = {**common, "temperature": (0.0, 0.7, 1.2)[i % 3], "response_format": {
                "type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                       "strict": True}}}
            out.append(Job(kind, "/v1/chat/completions", body, {"": schema}, None))
        else:
            body = {**common, "temperature": (0.0, 0.5, 1.0)[i % 3], "output_config": {
                "format": {"type": "json_schema", "schema": schema}}}
            out.append(Job(kind, "/v1/messages", body, {"": schema}, None))
    return out


def streamed(job: Job, stream: RecordedStream) -> tuple[str, list[tuple[str, str]], str | None]:
    """(text, [(function name, arguments JSON text)], finish or stop reason) of a stream."""
    text, calls, reason = "", [], None
    for event in stream.events:
        try:
            data = event.json()
        except ValueError:
            continue  # [DONE]
        if job.route == "/v1/messages":
            if data.get("type") == "content_block_start" \
                    and data["content_block"]["type"] == "tool_use":
                calls.append([data["content_block"]["name"], ""])
            elif data.get("type") == "content_block_delta":
                delta = data["delta"]
                if delta["type"] == "input_json_delta":
                    calls[-1][1] += delta["partial_json"]
                else:
                    text += delta["text"]
            elif data.get("type") == "message_delta":
                reason = data["delta"]["stop_reason"]
            continue
        for choice in data.get("choices") or ():
            delta = choice["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                if "id" in call:
                    calls.append([call["function"]["name"], ""])
                calls[call["index"]][1] += call["function"].get("arguments") or ""
            reason = choice.get("finish_reason") or reason
    return text, [tuple(c) for c in calls], reason


def problems(job: Job, stream: RecordedStream) -> list[str]:
    """Why the stream is not a valid constrained answer to job (empty: it is)."""
    text, calls, reason = streamed(job, stream)
    if job.kind in ("response_format", "output_format"):
        wanted = "stop" if job.kind == "response_format" else "end_turn"
        values = [text] if reason == wanted and not calls else []
        names = [""]
    else:
        names = [name for name, _ in calls]
        values = [arguments for _, arguments in calls]
        wanted = "tool_use" if job.kind == "anthropic_tool" else "tool_calls"
        if len(calls) != 1 or text:
            return [f"expected one call and no text, got {calls!r} and {text!r}"]
        if names[0] not in job.schemas or job.name not in (None, names[0]):
            return [f"called {names}, not {job.name or list(job.schemas)}"]
    if reason != wanted or not values:
        return [f"ended with {reason!r}, not {wanted!r}: {text!r} {calls!r}"]
    try:
        jsonschema.validate(json.loads(values[0]), job.schemas[names[0]])
    except (ValueError, jsonschema.ValidationError) as error:
        return [f"{values[0]!r}: {str(error)[:200]}"]
    return []


async def record_all(url: str, batch: list[Job], on_tokens=None) -> list[RecordedStream]:
    """Stream every job at once (integrity framing); on_tokens(j, n) as tokens arrive."""
    async def one(client, j, job):
        recorder = SSERecorder()
        async with client.stream("POST", job.route, json=job.body, headers=INTEGRITY) \
                as response:
            assert response.status_code == 200, await response.aread()
            async for chunk in response.aiter_bytes():
                for event in recorder.feed(chunk):
                    ext = (event.json() if event.data.startswith("{") else {}).get("tokstream")
                    if on_tokens and ext and ext.get("token_ids"):
                        on_tokens(j, len(ext["token_ids"]))
        return recorder.stream()

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*(one(client, j, job) for j, job in enumerate(batch)))
