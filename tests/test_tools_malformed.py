"""Malformed tool data, without a server. In: a history call whose arguments are not JSON is
taken as any string (OpenAI takes them; agents send back what models wrote) and shown to the
model as it came; arguments that are not a string are a 400 naming the field. Out: model output
whose call JSON cannot be read or sent on (an invalid escape, a raw newline in the name, a lone
surrogate, nesting past the recursion limit) is text or a call with what can be sent, on both
APIs, streamed and not, and never raises."""

import json

import pytest

from tokstream.server.tool_calls.anthropic_tools import ToolBlocks, content_blocks
from tokstream.server.api_errors import ApiError
from tokstream.server.api.openai_request import chat_messages
from tokstream.server.tool_calls.openai_tools import ToolDeltas, tool_message
from tokstream.server.tool_calls.tool_template import encode_chat, fallback_messages
from tokstream.server.tool_calls.tools import Tool, ToolRequest
from tokstream.text.tokenizer import dummy_tokenizer

ASK = {"role": "user", "content": "Weather in Paris?"}


def history(arguments) -> dict:
    return {"messages": [ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]}


@pytest.mark.parametrize("arguments", ['{"city": "Par', "not json at all", "[1, 2]", "7",
                                       '{"a": ' * 5000],
                         ids=["cut", "prose", "array", "number", "nested-past-the-limit"])
def test_arguments_that_are_not_a_json_object_are_shown_as_they_came(arguments):
    chat = chat_messages(history(arguments))
    assert chat[1]["tool_calls"][0]["function"]["arguments"] == arguments
    [_, call, _] = fallback_messages(chat, ())
    assert call["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                               f'{arguments}}}\n</tool_call>')


def test_a_json_object_is_shown_as_before_and_handed_to_templates_parsed():
    chat = chat_messages(history('{"city":"Paris"}'))
    assert chat[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert fallback_messages(chat, ())[1]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert chat_messages(history(""))[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_a_template_of_its_own_gets_the_string():
    tokenizer = dummy_tokenizer(512)
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                               "{% for c in m.tool_calls or [] %}<{{ c.function.arguments }}>"
                               "{% endfor %};{% endfor %}{% if tools %}tools{% endif %}")
    ids = encode_chat(tokenizer, chat_messages(history("{bad")), ())
    assert tokenizer.decode(ids) == "user:Weather in Paris?;assistant:<{bad>;tool:21 C;"


@pytest.mark.parametrize("arguments", [{"city": "Paris"}, 7, ["a"]])
def test_arguments_that_are_not_a_string_are_a_400_naming_the_field(arguments):
    with pytest.raises(ApiError) as error:
        chat_messages(history(arguments))
    assert str(error.value.message).startswith("messages.1.tool_calls.0.function.arguments:")
    json.dumps(history(arguments))  # a body a client can send


DEEP = "[" * 1000  # past the JSON decoder's recursion limit
MALFORMED = {
    "invalid-escape": '<tool_call>\n{"name": "get_\\q", "arguments": {}}\n</tool_call>',
    "newline-in-name": '<tool_call>\n{"name": "get\nweather", "arguments": {}}\n</tool_call>',
    "surrogate-name": '<tool_call>\n{"name": "\\ud800", "arguments": {}}\n</tool_call>',
    "deep-whole": f'<tool_call>\n{{"arguments": {DEEP}, "name": "f"}}\n</tool_call>',
}
"""Blocks that hold no call a response can carry: each is the text it was."""
TOOLS = ToolRequest((Tool("f", "", {"type": "object", "properties": {}}),))


def openai_outcomes(text: str, step: int) -> tuple[dict, list[dict]]:
    deltas = ToolDeltas(TOOLS)
    streamed = [d for at in range(0, len(text), step) for d in deltas.feed(text[at:at + step])]
    return tool_message(text, TOOLS), streamed + deltas.finish()


def anthropic_outcomes(text: str, step: int) -> list[tuple[str, dict]]:
    blocks = ToolBlocks(TOOLS)
    return [e for at in range(0, len(text), step) for e in blocks.feed(text[at:at + step])] \
        + blocks.finish()


def sendable(value) -> bool:
    return bool(json.dumps(value, ensure_ascii=False).encode("utf-8"))


@pytest.mark.parametrize("step", [1, 7, 100_000])
@pytest.mark.parametrize("kind", MALFORMED)
def test_a_block_that_cannot_be_sent_as_a_call_is_text(kind, step):
    text = "Hi " + MALFORMED[kind]
    message, deltas = openai_outcomes(text, step)
    assert message == {"role": "assistant", "content": text} and sendable(message)
    assert "".join(d["content"] for d in deltas) == text and sendable(deltas)
    events = anthropic_outcomes(text, step)
    assert content_blocks(events) == [{"type": "text", "text": text}] and sendable(events)


@pytest.mark.parametrize("arguments", [DEEP, '{"a": "\\ud800"}', '{"a": "b\nc"}'],
                         ids=["deep", "surrogate", "raw-newline"])
def test_a_call_whose_arguments_cannot_be_read_keeps_them_as_text_or_empty(arguments):
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}'
    message, deltas = openai_outcomes(text, 5)
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": arguments} and sendable(message)
    assert sendable(deltas)
    [block] = content_blocks(anthropic_outcomes(text, 5))
    assert block["type"] == "tool_use" and block["input"] == {} and sendable(block)
