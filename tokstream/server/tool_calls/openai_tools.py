"""OpenAI tool calling: `tools`, `tool_choice`, `parallel_tool_calls` and the history's
assistant `tool_calls` and `tool` messages read into the neutral shapes (tools.py), and the
parsed output written back as `message.tool_calls` or streamed `delta.tool_calls`."""

from __future__ import annotations

import json

from tokstream.server.api_errors import bad_request
from tokstream.server.tool_calls.tool_parser import (ArgumentsPiece, CallStart, Event, HermesParser,
                                              TextPiece, parse_output)
from tokstream.server.tool_calls.tools import Tool, ToolRequest, new_call_id, read_function, read_tools
from tokstream.server.validation import _kind, get_bool, shown

CALL_ID_PREFIX = "call_"


def tool_request(body: dict, read_one=None,
                 named_at: tuple[str, ...] = ("function", "name")) -> ToolRequest | None:
    """The request's tools and tool_choice (None: no tools, or tool_choice none), on both
    OpenAI APIs. read_one reads one tool (default: chat's shape); named_at is where a named
    choice holds the function's name (chat: function.name; the Responses API: name)."""
    items, choice = body.get("tools"), body.get("tool_choice")
    parallel = get_bool(body, "parallel_tool_calls", True)
    if not items:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice", "needs tools to choose from")
        return None
    tools = tuple(read_tools(items, read_one or read_tool))
    if choice is None or choice == "auto":
        return ToolRequest(tools, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(tools, "required", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice
        for key in named_at:
            name = name.get(key) if isinstance(name, dict) else None
        if name not in {t.name for t in tools}:
            raise bad_request(".".join(("tool_choice", *named_at)),
                              f"no tool is named {shown(name)}")
        return ToolRequest(tools, "named", name, parallel)
    named = "..."
    for key in reversed(named_at):
        named = f"{{'{key}': {named}}}"
    raise bad_request("tool_choice", "must be 'auto', 'none', 'required' or "
                                     f"{{'type': 'function', {named[1:-1]}}}, got "
                                     f"{shown(choice)}")


def read_tool(item, path: str) -> Tool:
    if not isinstance(item, dict):
        raise bad_request(path, f"must be an object, not {_kind(item)}")
    if item.get("type") != "function":
        raise bad_request(f"{path}.type", f"only 'function' tools are supported, got "
                                          f"{shown(item.get('type'))}")
    function = item.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{path}.function", "must be an object")
    return read_function(function.get("name"), function.get("description"),
                         function.get("parameters"), f"{path}.function", "parameters")


def tool_fields(message: dict, at: str) -> dict:
    """A history message's tool fields in transformers' chat shape: an assistant's
    `tool_calls` (arguments parsed), a tool result's `tool_call_id`."""
    if message.get("role") == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{at}.tool_call_id", "required: the id of the call answered")
        return {"tool_call_id": call_id}
    calls = message.get("tool_calls")
    if calls is None or message.get("role") != "assistant":
        return {}
    if not isinstance(calls, list):
        raise bad_request(f"{at}.tool_calls", "must be an array")
    return {"tool_calls": [history_call(call, f"{at}.tool_calls.{n}")
                           for n, call in enumerate(calls)]}


def history_call(call, at: str) -> dict:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise bad_request(f"{at}.type", "only 'function' calls are supported")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{at}.function.name", "required")
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str):
        raise bad_request(f"{at}.function.arguments", "must be a string (the call's arguments "
                                                      f"as the model wrote them), not "
                                                      f"{_kind(arguments)}")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": history_arguments(arguments)}}


def history_arguments(text: str | None) -> dict | str:
    """A past call's arguments: the object they hold, for templates that write them with
    `tojson`; any other string as it came. Models do write broken arguments and agents send
    them back (the OpenAI API takes any string here), so the prompt shows what was written."""
    try:
        value = json.loads(text or "{}")
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


class ToolDeltas:
    """One streamed choice's output as OpenAI deltas: `content` text, and `tool_calls`
    entries (the first of each call with its index, id and name, then argument pieces)."""

    def __init__(self, tools: ToolRequest):
        self.parser = HermesParser(max_calls=None if tools.parallel else 1)

    @property
    def made_calls(self) -> bool:
        return self.parser.num_calls > 0

    def feed(self, text: str) -> list[dict]:
        return [d for d in map(delta, self.parser.feed(text)) if d]

    def finish(self) -> list[dict]:
        return [d for d in map(delta, self.parser.finish()) if d]


def delta(event: Event) -> dict | None:
    match event:
        case TextPiece(text=text):
            return {"content": text}
        case CallStart(index=index, name=name):
            return {"tool_calls": [{"index": index, "id": new_call_id(CALL_ID_PREFIX),
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""}}]}
        case ArgumentsPiece(index=index, text=text):
            return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
    return None


def finish_reason(reason: str, made_calls: bool) -> str:
    """A turn that ended after its calls ends for them ("length" still says it was cut)."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def tool_message(text: str, tools: ToolRequest) -> dict:
    """The assistant message of a non-streaming response: its text and its calls."""
    parsed = parse_output(text, max_calls=None if tools.parallel else 1)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.text}
    return {"role": "assistant", "content": parsed.text or None, "tool_calls": [
        {"id": new_call_id(CALL_ID_PREFIX), "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
        for call in parsed.calls]}
