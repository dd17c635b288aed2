"""A Messages API history replayed from a reasoning model: its assistant turns' `thinking` and
`redacted_thinking` blocks are dropped, as the API drops earlier turns' reasoning, so the
prompt is the one the same history gives without them; elsewhere, or malformed, they are a
400 naming the block (pure Python: the route's message reader)."""

import pytest

from tokstream.server.api.anthropic_routes import chat_messages
from tokstream.server.api_errors import ApiError

THOUGHT = {"type": "thinking", "thinking": "The user greets me.", "signature": "EqQBCgIYAh"}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}


def history(*assistant_blocks) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": list(assistant_blocks)},
                         {"role": "user", "content": [RESULT]}]}


@pytest.mark.parametrize("blocks", [
    [{"type": "text", "text": "Let me check."}, CALL],
    [CALL],
])
def test_thinking_blocks_are_dropped_from_earlier_turns(blocks):
    plain = chat_messages(history(*blocks))
    assert chat_messages(history(THOUGHT, *blocks)) == plain
    assert chat_messages(history(REDACTED, THOUGHT, *blocks)) == plain


def test_a_text_turn_with_reasoning_reads_as_its_text():
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [THOUGHT, {"type": "text",
                                                                     "text": "Hello!"}]},
                         {"role": "user", "content": "again"}]}
    assert chat_messages(body)[1] == {"role": "assistant", "content": "Hello!"}


def test_a_turn_of_reasoning_alone_is_an_empty_turn():
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [THOUGHT]}]}
    assert chat_messages(body)[1] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("body, field", [
    (history({"type": "thinking", "signature": "x"}, CALL), "messages.1.content.0.thinking"),
    (history({"type": "redacted_thinking", "data": 5}, CALL), "messages.1.content.0.data"),
    ({"messages": [{"role": "user", "content": [THOUGHT]}]}, "messages.0.content.0.type"),
])
def test_reasoning_where_it_cannot_be_is_a_400_naming_it(body, field):
    with pytest.raises(ApiError) as error:
        chat_messages(body)
    assert error.value.status == 400 and error.value.param == field, error.value.message
