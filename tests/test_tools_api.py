"""Tool calling and structured outputs through the official SDKs against one `tokstream serve`
on dummy:tiny (random weights: only the grammar makes a forced call valid, and an `auto` call
is made by holding the model to a regex of text and calls): OpenAI tools streamed and not,
`beta.chat.completions.parse` with pydantic models, Anthropic tools with `messages.create` and
the `messages.stream` helper, Anthropic structured outputs (`messages.parse` and `stream` with
`output_format`), tool history on both APIs, count_tokens, clear 400s, model output that holds
no readable call, and constrained streams that stay valid through a rank killed
mid-generation."""

import asyncio
import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from helpers.serving import module_server
from tokstream.checker import check_streams
from helpers.tool_workload import ALL_KINDS, NAMES, SCHEMAS, jobs, problems, record_all

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

MODEL = "dummy:tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "description": f"tool {n}",
                                                  "parameters": s}}
                for n, s in zip(NAMES[:2], SCHEMAS[:2])]
ANTHROPIC_TOOLS = [{"name": n, "description": f"tool {n}", "input_schema": s}
                   for n, s in zip(NAMES[:2], SCHEMAS[:2])]
SCHEMA_OF = dict(zip(NAMES, SCHEMAS))
SPOKEN = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
          '"Pa</tool_call>"}}\n</tool_call>\n<tool_call>\n{"name": "count", "arguments": '
          '{"n": 3}}\n</tool_call>')
"""What an `auto` turn's model is held to (structured_outputs regex): text, then two calls,
the first with the closing tag inside a string."""


server = module_server("--profile", "ci")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def valid(name: str, arguments) -> bool:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMA_OF[name])
    return True


class Weather(BaseModel):
    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


class Forecast(BaseModel):
    """The SDK moves string and number bounds into descriptions for the API (its
    transform_schema), so only enums and booleans keep a random model's answer short."""

    unit: Literal["c", "f"]
    rain: bool
    day: Literal["mon", "tue", "wed"]


def sdk_calls(oai, claude) -> dict:
    """Every SDK request the tests below read, by name (each made at once, on its own
    thread: the engine batches them, so the module costs about its longest request)."""
    auto = dict(model=MODEL, messages=ASK, tools=OPENAI_TOOLS, max_tokens=400,
                extra_body={"structured_outputs": {"regex": re.escape(SPOKEN)}})
    short = dict(model=MODEL, max_tokens=2, temperature=0)

    def anthropic_stream():
        with claude.messages.stream(model=MODEL, max_tokens=256, messages=ASK,
                                    tools=ANTHROPIC_TOOLS, extra_body={"seed": 8},
                                    tool_choice={"type": "tool", "name": "get_weather"}
                                    ) as stream:
            kinds = [event.type for event in stream]
            return kinds, stream.get_final_message()

    def anthropic_parse_stream():
        with claude.messages.stream(model=MODEL, max_tokens=64, messages=ASK,
                                    output_format=Forecast, extra_body={"temperature": 0}
                                    ) as stream:
            return stream.get_final_message()

    return {
        "required": lambda: oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=OPENAI_TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=256, temperature=1.0, seed=3),
        "named_stream": lambda: list(oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=OPENAI_TOOLS, max_tokens=256, temperature=0.8,
            seed=5, stream=True,
            tool_choice={"type": "function", "function": {"name": "count"}})),
        "auto": lambda: oai.chat.completions.create(**auto),
        "auto_stream": lambda: list(oai.chat.completions.create(**auto, stream=True)),
        "auto_single": lambda: oai.chat.completions.create(**auto, parallel_tool_calls=False),
        "history": lambda: oai.chat.completions.create(messages=OPENAI_HISTORY,
                                                       tools=OPENAI_TOOLS, **short),
        "asked": lambda: oai.chat.completions.create(messages=ASK, tools=OPENAI_TOOLS, **short),
        "unshown": lambda: oai.chat.completions.create(messages=ASK, tools=OPENAI_TOOLS,
                                                       tool_choice="none", **short),
        "plain": lambda: oai.chat.completions.create(messages=ASK, **short),
        "parse": lambda: oai.beta.chat.completions.parse(
            model=MODEL, messages=ASK, max_tokens=256, response_format=Weather, seed=2),
        "parse_tool": lambda: oai.beta.chat.completions.parse(
            model=MODEL, messages=ASK, max_tokens=256, seed=4, tool_choice="required",
            tools=[openai.pydantic_function_tool(Weather)], parallel_tool_calls=False),
        "any": lambda: claude.messages.create(
            model=MODEL, max_tokens=256, messages=ASK, tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any"}, extra_body={"temperature": 1.0, "seed": 7}),
        "anthropic_stream": anthropic_stream,
        "anthropic_parse": lambda: claude.messages.parse(
            model=MODEL, max_tokens=64, messages=ASK, output_format=Forecast,
            extra_body={"temperature": 1.0, "seed": 3}),
        "anthropic_parse_stream": anthropic_parse_stream,
        "anthropic_history": lambda: claude.messages.create(
            model=MODEL, max_tokens=2, messages=ANTHROPIC_HISTORY, tools=ANTHROPIC_TOOLS,
            extra_body={"temperature": 0}),
    }


OPENAI_HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
ANTHROPIC_HISTORY = [*ASK, {"role": "assistant", "content": [
    {"type": "text", "text": "Checking."},
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
     "input": {"city": "Paris", "unit": "c"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"},
        {"type": "text", "text": "And tomorrow?"}]}]


@pytest.fixture(scope="module")
def answers(oai, claude) -> dict:
    calls = sdk_calls(oai, claude)
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def test_openai_required_call(answers):
    choice = answers["required"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert valid(call.function.name, call.function.arguments)


def test_openai_named_call_streams_in_pieces(answers):
    chunks = answers["named_stream"]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [call for d in deltas for call in d.tool_calls or ()]
    first = pieces[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "count"
    assert len(pieces) > 3 and all(p.index == 0 and p.id is None for p in pieces[1:])
    assert valid("count", "".join(p.function.arguments or "" for p in pieces))
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        ["tool_calls"]


def test_openai_auto_splits_text_from_calls(answers):
    """No markup in the content, streamed or not; parallel_tool_calls=false keeps one call."""
    reply = answers["auto"].choices[0]
    assert reply.message.content == "Let me check." and reply.finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert calls == [("get_weather", '{"city": "Pa</tool_call>"}'), ("count", '{"n": 3}')]
    content, streamed = "", {}
    for chunk in answers["auto_stream"]:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = streamed.setdefault(call.index, [call.function.name, ""])
            entry[1] += call.function.arguments or ""
    assert content == "Let me check." and [tuple(streamed[i]) for i in (0, 1)] == calls
    one = answers["auto_single"].choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]


def test_openai_history_with_calls_and_results(answers):
    tokens = {name: answers[name].usage.prompt_tokens
              for name in ("history", "asked", "unshown", "plain")}
    assert tokens["history"] > tokens["asked"] + 30
    assert tokens["unshown"] == tokens["plain"]  # tool_choice none: the tools are not shown
    assert tokens["asked"] > tokens["plain"] + 100


def test_openai_parse_helpers_return_parsed_objects(answers):
    assert isinstance(answers["parse"].choices[0].message.parsed, Weather)
    [call] = answers["parse_tool"].choices[0].message.tool_calls
    assert call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)


def test_anthropic_any_tool(answers):
    message = answers["any"]
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content][-1] == "tool_use"
    for block in message.content:
        assert block.type == "tool_use" and block.id.startswith("toolu_")
        assert valid(block.name, block.input)


def test_anthropic_stream_helper_gives_a_tool_use_block(answers):
    kinds, message = answers["anthropic_stream"]
    [block] = message.content
    assert isinstance(block, anthropic.types.ToolUseBlock) and block.name == "get_weather"
    assert isinstance(block.input, dict) and valid("get_weather", block.input)
    assert message.stop_reason == "tool_use" and kinds.count("input_json") > 3
    assert kinds[:2] == ["message_start", "content_block_start"]


def test_anthropic_history_and_count_tokens(answers, claude):
    usage = answers["anthropic_history"].usage
    counted = claude.messages.count_tokens(model=MODEL, messages=ANTHROPIC_HISTORY,
                                           tools=ANTHROPIC_TOOLS)
    assert usage.input_tokens + usage.cache_read_input_tokens \
        + usage.cache_creation_input_tokens == counted.input_tokens
    bare = claude.messages.count_tokens(model=MODEL, messages=ASK)
    with_tools = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert with_tools.input_tokens > bare.input_tokens + 100


def test_anthropic_parse_gives_the_output_format_streamed_and_not(answers):
    for name in ("anthropic_parse", "anthropic_parse_stream"):
        message = answers[name]
        assert isinstance(message.parsed_output, Forecast), message.content
        assert message.stop_reason == "end_turn" and [b.type for b in message.content] == [
            "text"]


def anthropic_body(**extra):
    return {"model": MODEL, "max_tokens": 8, "messages": ASK, **extra}


def openai_body(**extra):
    return {"model": MODEL, "max_tokens": 8, "messages": ASK, **extra}


FORMAT = {"type": "json_schema", "schema": {"type": "object"}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                       "content": [{"type": "text", "text": "ok"}, IMAGE]}]}


@pytest.mark.parametrize("route, body, field", [
    ("/v1/messages", anthropic_body(messages=[RESULT]), "messages.0.content.0.content.1.type"),
    ("/v1/messages", anthropic_body(tools=[{"type": "web_search_20250305", "name": "w"}]),
     "tools.0.type"),
    ("/v1/messages", anthropic_body(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool",
                                                                        "name": "nope"}),
     "tool_choice.name"),
    ("/v1/messages", anthropic_body(tool_choice={"type": "any"}), "tool_choice"),
    ("/v1/messages", anthropic_body(tools=[{"name": "a b", "input_schema": {}}]),
     "tools.0.name"),
    ("/v1/messages", anthropic_body(tools=[{"name": "f", "input_schema": {"type": "nope"}}]),
     "tools.0.input_schema"),
    ("/v1/messages", anthropic_body(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), "messages.0.content.0.type"),
    ("/v1/chat/completions", openai_body(tools=[{"type": "custom", "custom": {}}]),
     "tools.0.type"),
    ("/v1/chat/completions", openai_body(tools=OPENAI_TOOLS * 2), "tools"),
    ("/v1/chat/completions", openai_body(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", openai_body(tools=OPENAI_TOOLS, tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    ("/v1/chat/completions", openai_body(tools=OPENAI_TOOLS, tool_choice="required",
                                         response_format={"type": "json_object"}),
     "tool_choice"),
    ("/v1/chat/completions", openai_body(messages=[*ASK, {"role": "tool", "content": "x"}]),
     "messages.1.tool_call_id"),
    ("/v1/chat/completions", openai_body(messages=[*ASK, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]),
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", openai_body(functions=[{"name": "f"}]), "functions"),
    ("/v1/messages", anthropic_body(output_config={"format": {"type": "xml"}}),
     "output_config.format.type"),
    ("/v1/messages", anthropic_body(output_config={"format": {"type": "json_schema"}}),
     "output_config.format.schema"),
    ("/v1/messages", anthropic_body(output_config={"format": {
        "type": "json_schema", "schema": {"type": "nope"}}}), "output_config.format.schema"),
    ("/v1/messages", anthropic_body(output_config={"effort": "huge"}), "output_config.effort"),
    ("/v1/messages", anthropic_body(output_format=FORMAT, output_config={"format": FORMAT}),
     "output_format"),
    ("/v1/messages", anthropic_body(output_format=FORMAT, messages=[
        *ASK, {"role": "assistant", "content": "{"}]), "messages.1"),
    ("/v1/messages", anthropic_body(output_config={"format": FORMAT}, tools=ANTHROPIC_TOOLS,
                                    tool_choice={"type": "any"}), "tool_choice"),
])
def test_unsupported_is_a_400_naming_the_field(server, route, body, field):
    response = httpx.post(server.url + route, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(field + ":"), error


def test_constrained_streams_stay_valid_through_a_rank_kill(server):
    """Forced calls and output formats on both APIs (response_format,
    output_config.format), varied schemas, seeds and temperatures, at once; rank 0 is killed
    when the first has 20 tokens: every stream resumes, ends once, and parses and validates
    against its schema."""
    batch = jobs(16, kinds=ALL_KINDS)
    rank = server.state()["ranks"][0]["pid"]
    received = [0] * len(batch)

    def on_tokens(j, n):
        received[j] += n
        if j == 0 and received[0] >= 20 and received[0] - n < 20:
            os.kill(rank, signal.SIGKILL)

    streams = asyncio.run(record_all(server.url, batch, on_tokens))
    report = check_streams(streams)
    assert report.ok, report.summary()
    assert report.statuses == {"complete": len(batch), "failed": 0, "cut": 0}
    assert [p for job, s in zip(batch, streams) for p in problems(job, s)] == []
    state = server.wait_idle(timeout=120)
    assert state["replica"]["restarts"] == 1 and state["replica"]["status"] == "ready"


MALFORMED_CALLS = {
    "invalid-escape": '<tool_call>\n{"name": "get_\\q", "arguments": {}}\n</tool_call>',
    "newline-in-name": '<tool_call>\n{"name": "get\nweather", "arguments": {}}\n</tool_call>',
    "surrogate-name": '<tool_call>\n{"name": "\\ud800", "arguments": {}}\n</tool_call>',
    "deep": '<tool_call>\n{"arguments": ' + "[" * 1000 + '</tool_call>',
}
"""Model output whose call cannot be read (the last nests past the JSON decoder's recursion
limit), which a structured_outputs regex makes even a random model write."""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", MALFORMED_CALLS)
def test_model_output_that_is_no_readable_call_is_text_not_a_5xx(server, kind, stream):
    text = MALFORMED_CALLS[kind]
    # One bare tool: the deep block is 1,000+ byte tokens of dummy:tiny's 2,048 context.
    body = openai_body(tools=[{"type": "function", "function": {"name": "f"}}],
                       max_tokens=len(text) + 8, stream=stream,
                       structured_outputs={"regex": re.escape(text)})
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=120) as response:
        raw = response.read().decode()
    assert response.status_code == 200, raw[:300]
    if not stream:
        choice = json.loads(raw)["choices"][0]
        assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"
        return
    chunks = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: {")]
    assert raw.rstrip().endswith("data: [DONE]") and not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c.get("choices")) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
