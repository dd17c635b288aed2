"""Tool calling without a server: the Hermes parser (streamed in any split, no markup in the
text, a `</tool_call>` inside a string, blocks that are not calls, one call without parallel
calls), the Anthropic block events, the prompt (fallback and a template of the model's own
that takes tools) and the forced-call grammar."""

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from tokstream.server.tool_calls.anthropic_tools import ToolBlocks, content_blocks
from tokstream.server.tool_calls.openai_tools import ToolDeltas, tool_message
from tokstream.server.tool_calls.tool_parser import (ArgumentsPiece, CallEnd, CallStart, HermesParser,
                                              TextPiece, parse_output)
from tokstream.server.tool_calls.tool_template import FALLBACK_PROMPT, encode_chat, fallback_messages
from tokstream.server.tool_calls.tools import Tool, ToolRequest
from tokstream.text.tokenizer import dummy_tokenizer

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False})
SEARCH = Tool("search", "", {"type": "object", "properties": {"q": {"type": "string"}}})
OUTPUT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
          '"P}a</tool_call>ris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"arguments": '
          '{"q": "x"}, "name": "search"}\n</tool_call>\nDone <tool')


def run(text: str, step: int, max_calls=None) -> list:
    parser = HermesParser(max_calls)
    events = []
    for at in range(0, len(text), step):
        events += parser.feed(text[at:at + step])
    return events + parser.finish()


def summary(events) -> tuple[str, list[tuple[str, str]]]:
    text, calls = "", []
    for event in events:
        match event:
            case TextPiece(text=piece):
                text += piece
            case CallStart(name=name):
                calls.append([name, ""])
            case ArgumentsPiece(text=piece):
                calls[-1][1] += piece
    return text, [tuple(c) for c in calls]


@pytest.mark.parametrize("step", [1, 2, 5, 13, 1000])
def test_any_split_of_the_stream_parses_the_same(step):
    text, calls = summary(run(OUTPUT, step))
    assert text == "Let me look.\nDone <tool"  # a prefix never completed is the model's text
    assert calls == [("get_weather", '{"city": "P}a</tool_call>ris", "unit": "c"}'),
                     ("search", '{"q": "x"}')]
    assert parse_output(OUTPUT).text == text


def test_no_markup_is_ever_streamed_as_text():
    events = run(OUTPUT[:OUTPUT.index("Done")], 1)
    streamed = "".join(e.text for e in events if isinstance(e, TextPiece))
    assert "<" not in streamed and streamed == "Let me look."
    # the call is announced at its name, before its arguments, then they stream in pieces
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("CallStart") < kinds.index("ArgumentsPiece")
    assert kinds.count("ArgumentsPiece") > 10 and kinds.count("CallEnd") == 2


def test_held_back_prefix_and_whitespace_are_released_when_no_call_follows():
    parser = HermesParser()
    assert parser.feed("a <tool") == [TextPiece("a")]
    assert parser.feed("box> b ") == [TextPiece(" <toolbox> b")]
    assert parser.finish() == [TextPiece(" ")]


@pytest.mark.parametrize("block", ["<tool_call>not json</tool_call>",
                                   '<tool_call>{"arguments": {}}</tool_call>'])
def test_a_block_that_is_not_a_call_is_text(block):
    parsed = parse_output(f"x {block} y")
    assert parsed.calls == [] and parsed.text == f"x {block} y"


def test_a_call_cut_short_ends_with_what_it_had():
    parsed = parse_output('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"a": [1, 2')]
    events = run('<tool_call>\n{"name": "f", "argu', 3)
    assert summary(events) == ('<tool_call>\n{"name": "f", "argu', [])


def test_without_parallel_calls_the_turn_ends_at_the_first_call():
    text, calls = summary(run(OUTPUT, 3, max_calls=1))
    assert text == "Let me look." and [c[0] for c in calls] == ["get_weather"]


def test_openai_deltas_and_message():
    deltas = ToolDeltas(ToolRequest((WEATHER, SEARCH)))
    out = [d for n in range(0, len(OUTPUT), 4) for d in deltas.feed(OUTPUT[n:n + 4])]
    out += deltas.finish()
    starts = [d["tool_calls"][0] for d in out if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [(s["index"], s["function"]["name"]) for s in starts] == [(0, "get_weather"),
                                                                     (1, "search")]
    assert all(s["id"].startswith("call_") for s in starts) and deltas.made_calls
    message = tool_message(OUTPUT, ToolRequest((WEATHER, SEARCH), parallel=False))
    assert message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert tool_message("plain", ToolRequest((WEATHER,))) == {"role": "assistant",
                                                             "content": "plain"}


def test_anthropic_blocks_open_and_close_in_order():
    blocks = ToolBlocks(ToolRequest((WEATHER, SEARCH)))
    events = [e for n in range(0, len(OUTPUT), 7) for e in blocks.feed(OUTPUT[n:n + 7])]
    events += blocks.finish()
    opened = [(d["index"], d["content_block"]["type"]) for name, d in events
              if name == "content_block_start"]
    assert opened == [(0, "text"), (1, "tool_use"), (2, "tool_use"), (3, "text")]
    stops = [d["index"] for name, d in events if name == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    for name, data in events:  # every delta lands in the block open at that moment
        if name == "content_block_delta":
            kind = "text_delta" if opened[data["index"]][1] == "text" else "input_json_delta"
            assert data["delta"]["type"] == kind
    content = content_blocks(events)
    assert content[1]["input"] == {"city": "P}a</tool_call>ris", "unit": "c"}
    assert content[2]["input"] == {"q": "x"} and content[3]["text"] == "\nDone <tool"


def test_fallback_prompt_renders_tools_calls_and_results():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "21 C", "tool_call_id": "c1"},
                {"role": "tool", "content": "sunny", "tool_call_id": "c2"},
                {"role": "user", "content": "Thanks"}]
    out = fallback_messages(messages, (WEATHER,))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n" + FALLBACK_PROMPT.split("{")[0])
    assert json.dumps(WEATHER.template_entry()) in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Paris"}}\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n21 C\n</tool_response>\n<tool_response>\n"
                                 "sunny\n</tool_response>\nThanks")
    assert all(set(m) == {"role", "content"} for m in out)


def test_a_template_that_takes_tools_gets_them_itself():
    tokenizer = dummy_tokenizer(512)
    tokenizer.chat_template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                               "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                               "{% for c in m.tool_calls or [] %}<{{ c.function.name }}>"
                               "{% endfor %};{% endfor %}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "search", "arguments": {}}}]}]
    ids = encode_chat(tokenizer, messages, (WEATHER, SEARCH))
    assert tokenizer.decode(ids) == "[get_weather][search]user:hi;assistant:<search>;"
    assert tokenizer.decode(encode_chat(tokenizer, messages[:1])) == "user:hi;"


def test_a_forced_grammar_accepts_only_valid_calls_of_the_allowed_tools():
    tokenizer = dummy_tokenizer(512)
    ll = LLTokenizer(tokenizer.to_json(), n_vocab=512, eos_token=[0])

    def accepts(request: ToolRequest, text: str) -> bool:
        matcher = LLMatcher(ll, request.structured().grammar(), log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}' \
           '\n</tool_call>'
    both = ToolRequest((WEATHER, SEARCH), "required")
    assert accepts(both, call) and accepts(both, call + "\n" + call)
    assert not accepts(ToolRequest((WEATHER, SEARCH), "required", parallel=False),
                       call + "\n" + call)
    assert not accepts(ToolRequest((WEATHER, SEARCH), "named", "search"), call)
    assert not accepts(both, call.replace('"c"', '"k"'))  # the schema's enum
    assert not accepts(both, "Sure. " + call)
    assert ToolRequest((WEATHER,)).structured() is None  # auto: the model is free
    nested = Tool("put", "", {"$defs": {"Item": {"type": "object", "properties": {
        "id": {"type": "integer"}}, "required": ["id"]}}, "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"]})
    put = ToolRequest((nested,), "named", "put")  # pydantic's nested models refer to $defs
    assert accepts(put, '<tool_call>\n{"name": "put", "arguments": {"item": {"id": 4}}}'
                        '\n</tool_call>')
    assert not accepts(put, '<tool_call>\n{"name": "put", "arguments": {"item": {}}}'
                            '\n</tool_call>')
