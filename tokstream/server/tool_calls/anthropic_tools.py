"""Anthropic tool use: `tools`, `tool_choice` and the history's `tool_use` / `tool_result`
blocks read into the neutral shapes (tools.py), and the parsed output written back as
content blocks: a text block for text, a `tool_use` block per call (streamed as
content_block_start, `input_json_delta` pieces, content_block_stop)."""

from __future__ import annotations

from tokstream.server.api_errors import bad_request
from tokstream.server.tool_calls.tool_parser import (ArgumentsPiece, CallEnd, CallStart, Event,
                                              HermesParser, TextPiece, json_value)
from tokstream.server.tool_calls.tools import Tool, ToolRequest, new_call_id, read_function, read_tools
from tokstream.server.validation import _kind, get_bool, shown

CALL_ID_PREFIX = "toolu_"
CHOICE_TYPES = {"auto": "auto", "any": "required", "tool": "named"}
BLOCKS_BY_ROLE = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


def tool_request(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice (None: no tools, or tool_choice none)."""
    items, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and not isinstance(choice, dict):
        raise bad_request("tool_choice", f"must be an object, not {_kind(choice)}")
    choice = choice or {"type": "auto"}
    kind = choice.get("type")
    if kind not in (*CHOICE_TYPES, "none"):
        raise bad_request("tool_choice.type", f"must be auto, any, tool or none, got "
                                              f"{shown(kind)}")
    parallel = not get_bool(choice, "disable_parallel_tool_use")
    if not items:
        if kind not in ("auto", "none"):
            raise bad_request("tool_choice", "needs tools to choose from")
        return None
    tools = read_tools(items, read_tool)
    if kind == "none":
        return None
    name = choice.get("name") if kind == "tool" else None
    if kind == "tool" and name not in {t.name for t in tools}:
        raise bad_request("tool_choice.name", f"no tool is named {shown(name)}")
    return ToolRequest(tuple(tools), CHOICE_TYPES[kind], name, parallel)


def read_tool(item, path: str) -> Tool:
    if not isinstance(item, dict):
        raise bad_request(path, f"must be an object, not {_kind(item)}")
    if item.get("type", "custom") != "custom":
        raise bad_request(f"{path}.type", f"server and client tools of Anthropic's own "
                                          f"({shown(item.get('type'))}) are not supported; "
                                          "define the tool with name and input_schema")
    if item.get("input_schema") is None:
        raise bad_request(f"{path}.input_schema", "required")
    return read_function(item.get("name"), item.get("description"), item.get("input_schema"),
                         path, "input_schema")


def history_messages(role: str, blocks: list, at: str) -> list[dict]:
    """One message's content blocks in transformers' chat shape: its text, an assistant's
    tool_use blocks as `tool_calls`, a user's tool_result blocks as `tool` messages (before
    the user's text, as the API orders them)."""
    texts, calls, results = [], [], []
    for n, block in enumerate(blocks):
        path = f"{at}.{n}"
        if not isinstance(block, dict):
            raise bad_request(path, f"must be a content block object, not {_kind(block)}")
        kind = block.get("type")
        if kind not in BLOCKS_BY_ROLE[role]:
            raise bad_request(f"{path}.type", f"only {' and '.join(BLOCKS_BY_ROLE[role])} "
                                              f"blocks are supported in a {role} message, "
                                              f"got {shown(kind)}")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{path}.text", "must be a string")
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append(history_call(block, path))
        else:
            results.append(tool_result(block, path))
    message = {"role": role, "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return results + ([message] if texts or calls else [])


def history_call(block: dict, at: str) -> dict:
    if not isinstance(block.get("id"), str):
        raise bad_request(f"{at}.id", "required")
    if not isinstance(block.get("name"), str):
        raise bad_request(f"{at}.name", "required")
    if not isinstance(block.get("input"), dict):
        raise bad_request(f"{at}.input", "must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": block["input"]}}


def tool_result(block: dict, at: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"{at}.tool_use_id", "required: the id of the tool_use answered")
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for n, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = "images" if kind == "image" else f"{shown(kind)} blocks"
                raise bad_request(f"{at}.content.{n}.type", f"{what} in tool results are not "
                                                            "supported; only text")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise bad_request(f"{at}.content", "must be a string or an array of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "content": content, "tool_call_id": block["tool_use_id"]}


class ToolBlocks:
    """One streamed message's content blocks: (event name, data) pairs for the parser's
    events, a text block opened at the first text and one tool_use block per call."""

    def __init__(self, tools: ToolRequest):
        self.parser = HermesParser(max_calls=None if tools.parallel else 1)
        self.index = -1
        """The current block's index (-1 before the first)."""
        self.open: str | None = None
        """The type of the block open now, if one is."""

    @property
    def made_calls(self) -> bool:
        return self.parser.num_calls > 0

    def feed(self, text: str) -> list[tuple[str, dict]]:
        return [e for event in self.parser.feed(text) for e in self._events(event)]

    def finish(self) -> list[tuple[str, dict]]:
        events = [e for event in self.parser.finish() for e in self._events(event)]
        return events + self._close()

    def _events(self, event: Event) -> list[tuple[str, dict]]:
        match event:
            case TextPiece(text=text):
                out = [] if self.open == "text" else self._start(
                    {"type": "text", "text": ""})
                return out + [self._delta({"type": "text_delta", "text": text})]
            case CallStart(name=name):
                return self._start({"type": "tool_use", "id": new_call_id(CALL_ID_PREFIX),
                                    "name": name, "input": {}})
            case ArgumentsPiece(text=text):
                return [self._delta({"type": "input_json_delta", "partial_json": text})]
            case CallEnd():
                return self._close()
        return []

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [("content_block_start", {"type": "content_block_start",
                                               "index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                       "delta": delta}

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def content_blocks(events: list[tuple[str, dict]]) -> list[dict]:
    """The finished content of a non-streaming message, from its stream's events (each
    call's input parsed; a call cut short by max_tokens, or whose JSON cannot be read or sent
    on, gets {})."""
    blocks, pieces = [], []  # each block's text or input JSON, joined at the end
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
            pieces.append([])
        elif name == "content_block_delta":
            delta = data["delta"]
            pieces[-1].append(delta["text"] if delta["type"] == "text_delta"
                              else delta["partial_json"])
    for block, parts in zip(blocks, pieces):
        if block["type"] == "tool_use":
            block["input"] = json_value("".join(parts) or "{}", dict) or {}
        else:
            block["text"] += "".join(parts)
    return blocks


def tool_stop_reason(reason: str, sequence: str | None, made_calls: bool
                     ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a turn that ended after its calls ends for them."""
    return ("tool_use", None) if made_calls and reason == "end_turn" else (reason, sequence)
