"""Tool calling, independent of the API that asked: the functions a request offers, how it
lets the model use them (tool_choice), and the grammar that enforces a forced call.

Both APIs read their own request shapes into a ToolRequest (openai_tools.py,
anthropic_tools.py); the prompt shows the tools through the model's template or the Hermes
fallback (tool_template.py); the output is split into text and calls by the Hermes parser
(tool_parser.py). A forced call (OpenAI `required` or a named function, Anthropic `any` or
`tool`) is written under an llguidance grammar: `<tool_call>` markup around a JSON object whose
`arguments` match the function's parameter schema, so even a 135M model's call is valid.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tokstream.errors import UserInputError
from tokstream.server.api_errors import bad_request
from tokstream.structured import JSON_LAYOUT, StructuredOutput

CHOICES = ("auto", "required", "named")
"""How the model may use the tools: as it likes, at least one call, or one call of `name`
(a `none` choice is no ToolRequest at all: the tools are left out of the prompt)."""
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function name as both APIs allow it."""
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    """1-64 letters, digits, '_' or '-' (NAME); unique among the request's tools."""
    description: str
    """What the function does, as the model reads it in the prompt ('' when none was given)."""
    parameters: dict
    """JSON schema of the call's arguments (an object; one without properties when none was
    given), refused when read if the grammar engine cannot compile it: a forced call's grammar
    holds the arguments to it."""

    def template_entry(self) -> dict:
        """As chat templates take it (transformers' `tools=` shape)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one request and how the model may use them."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    """One of CHOICES."""
    name: str | None = None
    """The function a `named` choice forces."""
    parallel: bool = True
    """More than one call in a turn (a forced one: one or more; off: exactly one)."""

    def __post_init__(self):
        if self.choice not in CHOICES:
            raise UserInputError(f"tool choice must be one of {', '.join(CHOICES)}")
        if self.choice == "named" and self.name not in {t.name for t in self.tools}:
            raise UserInputError(f"no tool is named {self.name!r}")

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def structured(self) -> StructuredOutput | None:
        """The grammar a forced choice samples under (None for auto: the model writes what it
        likes and the parser reads it)."""
        if not self.forced:
            return None
        tools = [t for t in self.tools if self.choice != "named" or t.name == self.name]
        rules = [f"fn{n}: %json {json.dumps(call_schema(t))}" for n, t in enumerate(tools)]
        # A named choice is one call, as OpenAI's and Anthropic's forced tool_choice are.
        many = self.parallel and self.choice == "required"
        lark = "\n".join([
            'start: call ("\\n" call)*' if many else "start: call",
            f'call: "{OPEN_TAG}\\n" ({" | ".join(f"fn{n}" for n in range(len(tools)))}) '
            f'"\\n{CLOSE_TAG}"', *rules])
        return StructuredOutput("grammar", lark)


def call_schema(tool: Tool) -> dict:
    """The JSON of one Hermes call of tool: its name, then arguments matching its schema (in
    that order, so a stream can name the function before its arguments arrive)."""
    arguments = dict(tool.parameters)
    # References such as "#/$defs/Item" (pydantic's nested models) resolve from the root.
    definitions = {k: arguments.pop(k) for k in ("$defs", "definitions") if k in arguments}
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": JSON_LAYOUT, **definitions}


def new_call_id(prefix: str) -> str:
    """A tool call's id (`call_…` for OpenAI, `toolu_…` for Anthropic)."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def tool_sampling(tools: ToolRequest | None, structured) -> dict:
    """SamplingParams arguments for a forced call: its grammar and the compiled form.
    structured: the request's own response format (both cannot constrain one output)."""
    forced = tools.structured() if tools is not None else None
    if forced is None:
        return {}
    if structured is not None:
        raise bad_request("tool_choice", "a forced tool call and a response format cannot "
                                         "both constrain the output; give one")
    try:
        return {"structured": forced, "grammar": forced.grammar()}
    except UserInputError as error:
        raise bad_request("tools", str(error)) from None


def read_tools(items, read_one) -> list[Tool]:
    """read_one(item, path) over a request's `tools` array, names checked unique."""
    if not isinstance(items, list):
        raise bad_request("tools", "must be an array of tools")
    tools = [read_one(item, f"tools.{n}") for n, item in enumerate(items)]
    seen = set()
    for tool in tools:
        if tool.name in seen:
            raise bad_request("tools", f"two tools are named {tool.name!r}")
        seen.add(tool.name)
    return tools


def read_function(name, description, parameters, path: str, parameters_key: str) -> Tool:
    """A Tool from one API's fields, each checked (400s name the field under path)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(f"{path}.name", "must be 1-64 letters, digits, '_' or '-'")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{path}.description", "must be a string")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{path}.{parameters_key}", "must be a JSON schema object")
    try:  # compiled here so a schema the grammar engine refuses is a 400 on its field
        StructuredOutput("json_schema", json.dumps(parameters)).grammar()
    except UserInputError as error:
        raise bad_request(f"{path}.{parameters_key}", str(error)) from None
    return Tool(name, description or "", parameters)
