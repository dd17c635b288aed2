"""The Hermes tool-call parser: model text in, as it streams, split into the text a caller
reads and the calls it makes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`).

No markup reaches the text: a suffix that may still become `<tool_call>` is held back until
the next piece decides it, and so is whitespace before it. A call is announced as soon as its
name is read and its arguments stream as they arrive (their end found by a JSON scanner, so a
`</tool_call>` inside a string does not end them). A block that does not hold a call (not JSON,
no name) is the model's text after all, and is returned as text, as vLLM's hermes parser does.
So is a block whose JSON cannot be read or sent on (an invalid escape, a raw newline in the
name, nesting past the recursion limit, a lone surrogate): model output never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tokstream.server.tool_calls.tools import CLOSE_TAG, OPEN_TAG

HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                  r'\s*:\s*')
"""A call's beginning, up to its arguments (the order the fallback prompt and the grammar
write; another order is read whole at the closing tag)."""


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    """0 for the output's first call, 1 for the next..."""
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    index: int
    text: str
    """The next characters of the call's arguments, as JSON text."""


@dataclass(frozen=True)
class CallEnd:
    index: int


Event = TextPiece | CallStart | ArgumentsPiece | CallEnd


class JsonValueEnd:
    """Where one JSON value ends, in text fed piece by piece."""

    def __init__(self):
        self.started = False
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.scalar = False
        self.done = False

    def feed(self, text: str) -> tuple[int, int]:
        """(start, end): text[start:end] belongs to the value (leading whitespace skipped);
        self.done once end is the value's end."""
        start = 0
        for n, char in enumerate(text):
            if not self.started:
                if char.isspace():
                    start = n + 1
                    continue
                self.started = True
                self.scalar = char not in '{["'
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return start, n + 1
            elif self.scalar:
                if char in ",}] \t\r\n":
                    self.done = True
                    return start, n
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return start, n + 1
        return start, len(text)


@dataclass
class HermesParser:
    """Feed it the output text as it comes; each call returns the events it decided."""

    max_calls: int | None = None
    """Calls in a turn (1 without parallel calls): the turn is over after the last, and
    whatever the model writes after it is dropped."""
    state: str = "text"
    """text, head (after <tool_call>, before the arguments), arguments, tail (after them, up
    to </tool_call>), or done (max_calls made)."""
    buffer: str = ""
    gap: str = ""
    """The whitespace before the open block: layout before a call, text before a block that
    turns out not to be one."""
    num_calls: int = 0
    arguments: JsonValueEnd = field(default_factory=JsonValueEnd)

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            moved_on = getattr(self, f"_{self.state}")(events)  # the state's own step
            if not moved_on:
                return events

    def finish(self) -> list[Event]:
        """The output ended: what was held back, and the end of a call left open (cut by
        max_tokens or by a stop sequence)."""
        events = self.feed("")
        index = self.num_calls - 1
        if self.state == "head":
            events += self._whole(self.buffer)
        elif self.state in ("arguments", "tail"):
            events.append(CallEnd(index))
        elif self.state == "text" and (self.buffer.strip() or not self.num_calls):
            _emit_text(events, self.buffer)  # whitespace after a call is layout
        self.state, self.buffer = "text", ""
        return events

    def _text(self, events: list[Event]) -> bool:
        at = self.buffer.find(OPEN_TAG)
        if at >= 0:
            before = self.buffer[:at].rstrip()
            _emit_text(events, before)
            self.gap = self.buffer[len(before):at]
            self.buffer = self.buffer[at + len(OPEN_TAG):]
            self.state = "head"
            return True
        held = _held_back(self.buffer)
        _emit_text(events, self.buffer[:held])
        self.buffer = self.buffer[held:]
        return False

    def _head(self, events: list[Event]) -> bool:
        match = HEAD.match(self.buffer)
        name = json_value(f'"{match.group(1)}"', str) if match else None
        if name is not None:
            events.append(CallStart(self.num_calls, name))
            self.num_calls += 1
            self.buffer = self.buffer[match.end():]
            self.arguments = JsonValueEnd()
            self.state = "arguments"
            return True
        at = self.buffer.find(CLOSE_TAG)
        if at < 0:
            return False
        events += self._whole(self.buffer[:at], CLOSE_TAG)
        self.buffer = self.buffer[at + len(CLOSE_TAG):]
        self._after_call()
        return True

    def _arguments(self, events: list[Event]) -> bool:
        start, end = self.arguments.feed(self.buffer)
        if end > start:
            events.append(ArgumentsPiece(self.num_calls - 1, self.buffer[start:end]))
        self.buffer = self.buffer[end:]
        if self.arguments.done:
            self.state = "tail"
            return True
        return False

    def _tail(self, events: list[Event]) -> bool:
        at = self.buffer.find(CLOSE_TAG)
        if at < 0:
            # Keep only what may hold the closing tag: anything else here (the object's "}",
            # stray keys) is not text and not arguments.
            self.buffer = self.buffer[-len(CLOSE_TAG):]
            return False
        events.append(CallEnd(self.num_calls - 1))
        self.buffer = self.buffer[at + len(CLOSE_TAG):]
        self._after_call()
        return True

    def _after_call(self) -> None:
        self.state = "done" if self.num_calls == self.max_calls else "text"

    def _done(self, events: list[Event]) -> bool:
        self.buffer = ""
        return False

    def _whole(self, inner: str, close: str = "") -> list[Event]:
        """A block read whole: a call if it is one, else the text it was (close: the closing
        tag it had, if any)."""
        call = json_value(inner, dict)
        if call is None or not isinstance(call.get("name"), str):
            return [TextPiece(self.gap + OPEN_TAG + inner + close)]
        index = self.num_calls
        self.num_calls += 1
        arguments = call.get("arguments", call.get("parameters", {}))
        return [CallStart(index, call["name"]),
                ArgumentsPiece(index, json.dumps(arguments, ensure_ascii=False)),
                CallEnd(index)]


def json_value(text: str, kind: type):
    """The value of type kind that the JSON text holds, or None when it holds none that a
    response can carry: malformed, nested past the recursion limit, or holding a lone
    surrogate (a `\\ud800` escape decodes to a str that UTF-8 cannot encode)."""
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return value if isinstance(value, kind) else None


def _emit_text(events: list[Event], text: str) -> None:
    if text:
        events.append(TextPiece(text))


def _held_back(text: str) -> int:
    """Where the part of text to hold back starts: a suffix that may begin <tool_call>, and
    the whitespace before it (layout, if a call follows)."""
    cut = len(text)
    for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if text.endswith(OPEN_TAG[:k]):
            cut = len(text) - k
            break
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return cut


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """JSON text (as the model wrote it: cut short when the output was)."""


@dataclass
class ParsedOutput:
    text: str
    calls: list[ParsedCall]


def parse_output(text: str, max_calls: int | None = None) -> ParsedOutput:
    """A whole output's text and calls (non-streaming responses)."""
    parser = HermesParser(max_calls)
    parts, calls = [], []
    for event in parser.feed(text) + parser.finish():
        match event:
            case TextPiece(text=piece):
                parts.append(piece)
            case CallStart(name=name):
                calls.append(ParsedCall(name, ""))
            case ArgumentsPiece(text=piece):
                calls[-1].arguments += piece
    return ParsedOutput("".join(parts), calls)
