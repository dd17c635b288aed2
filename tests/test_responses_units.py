"""The Responses API's pieces without a server: input items read into the chat the model is
shown, output text split into items and their events (the same whether it arrives whole or
in pieces), and the settings a response object repeats."""

import json

import pytest

from tokstream.server.api.responses_output import ResponseItems
from tokstream.server.api.responses_request import (chat_messages, input_items,
                                                    response_fields, tool_request)
from tokstream.server.api.conversation_store import ConversationStore
from tokstream.server.api_errors import ApiError

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat_of(body: dict) -> list[dict]:
    return chat_messages(body, input_items(body))


def test_input_items_become_the_chat_with_calls_and_their_outputs():
    chat = chat_of({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "weather in "},
                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Par'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "no such city"}]},
        {"role": "user", "content": "thanks"}]})
    assert chat == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "no such city", "tool_call_id": "call_2"},
        {"role": "user", "content": "thanks"}]


def test_a_call_after_a_tool_result_starts_a_new_assistant_turn():
    chat = chat_of({"input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"}]})
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in chat[3]["tool_calls"]] == ["b"]


def test_a_plain_string_input_is_one_user_message_and_every_item_gets_an_id():
    assert chat_of({"input": "hi"}) == [{"role": "user", "content": "hi"}]
    [item] = input_items({"input": "hi"})
    assert item["type"] == "message" and item["content"] == [{"type": "input_text",
                                                              "text": "hi"}]
    items = input_items({"input": [{"role": "user", "content": "a", "id": "msg_mine"},
                                   {"type": "function_call_output", "call_id": "c",
                                    "output": "1"}]})
    assert items[0]["id"] == "msg_mine" and items[1]["id"].startswith("fco_")
    with pytest.raises(ApiError, match="input: holds no message"):
        chat_of({"instructions": "x", "input": [{"type": "reasoning"}]})
    with pytest.raises(ApiError, match="input.1.call_id"):  # checked when read, not later
        input_items({"input": [{"role": "user", "content": "a"},
                               {"type": "function_call_output", "output": "1"}]})


def events_of(items: ResponseItems, pieces: list[str], state: str = "completed") -> list[dict]:
    return [e for piece in pieces for e in items.feed(piece)] + items.finish(state)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_text_then_a_call_make_two_items_however_the_text_is_split(step):
    text = "Let me look." + CALL
    items = ResponseItems(tool_request({"tools": [WEATHER]}))
    events = events_of(items, [text[i:i + step] for i in range(0, len(text), step)])
    kinds = [e["type"] for e in events]
    once = [k for n, k in enumerate(kinds) if n == 0 or k != kinds[n - 1]]  # deltas as one
    assert once == ["response.output_item.added", "response.content_part.added",
                    "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.output_item.done",
                    "response.output_item.added", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done"]
    message, call = items.output
    assert message["content"][0]["text"] == "Let me look." and message["status"] == "completed"
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta") == call["arguments"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    assert events[-1]["item"] == call and call["call_id"].startswith("call_")


def test_no_text_at_all_is_one_empty_message_and_a_cut_one_is_incomplete():
    items = ResponseItems(None)
    events = events_of(items, [""], "incomplete")
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert items.output[0]["content"][0]["text"] == ""
    assert items.output[0]["status"] == "incomplete"


def test_without_tools_call_markup_is_text():
    items = ResponseItems(None)
    events_of(items, [CALL])
    assert [i["type"] for i in items.output] == ["message"]
    assert items.output[0]["content"][0]["text"] == CALL


def test_a_response_repeats_the_requests_settings_with_the_apis_defaults():
    fields = response_fields({"input": "x", "metadata": {"k": "v"}, "tools": [WEATHER],
                              "tool_choice": "none"}, None, {"format": {"type": "text"}},
                             stored=False)
    assert fields["metadata"] == {"k": "v"} and fields["tool_choice"] == "none"
    assert fields["temperature"] == 1.0 and fields["top_p"] == 1.0
    assert fields["parallel_tool_calls"] is True and fields["store"] is False
    assert fields["truncation"] == "disabled" and fields["instructions"] is None


def stored(store: ConversationStore, owner: str, key: str, text: str = "x") -> bool:
    return store.put(owner, key, {"text": text})


def test_the_store_keeps_each_owners_responses_apart_and_evicts_the_largest_owner_first():
    one = len(json.dumps({"text": "x"}))
    store = ConversationStore(max_bytes=one * 4)
    assert stored(store, "b", "r1") and stored(store, "a", "r0")  # b's is the oldest
    assert store.get("a", "r0") is not None and store.get("b", "r0") is None  # not b's
    assert not store.delete("b", "r0") and store.get("a", "r0") is not None
    for n in range(2, 5):  # "a" floods: past the bound it loses its own oldest first
        stored(store, "a", f"r{n}")
    assert store.get("b", "r1") is not None and store.get("a", "r0") is None
    assert store.count() == 4 and store.bytes <= store.max_bytes
    assert store.delete("a", "r4") and store.get("a", "r4") is None
    assert not stored(store, "a", "big", "x" * one * 4)  # alone past the bound: not kept


def test_a_store_of_no_bytes_keeps_nothing():
    store = ConversationStore(max_bytes=0)
    assert not store.enabled and not stored(store, "a", "r0") and store.count() == 0
