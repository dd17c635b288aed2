"""Malformed tool data, without a server. In: a history call whose arguments are not JSON is
taken as any string (OpenAI takes them; agents send back what models wrote) and shown to the
model as it came; arguments that are not a string are a 400 naming the field."""

import json

import pytest

from tokstream.server.errors import ApiError
from tokstream.server.openai_request import chat_messages
from tokstream.server.tool_template import encode_chat, fallback_messages
from tokstream.tokenizer import dummy_tokenizer

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
