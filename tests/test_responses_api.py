"""POST /v1/responses, the OpenAI Responses API, through the official `openai` SDK and raw SSE
against a real `tokstream serve` on dummy:tiny (its text is gibberish: the framing, items,
calls and schemas are what is checked): created and streamed agree under a seed, the SDK's
stream helper accumulates the events into the same response, a raw stream passes the
integrity checker with gapless sequence numbers, a forced function call streams and round-trips
through function_call / function_call_output history, `text.format` json_schema parses into a
pydantic model, logprobs, and every refused field is a 400 naming it."""

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers.clients import offline_env  # noqa: F401 (fixture)
from helpers.serving import module_server
from tokstream.checker import SSERecorder, check_streams

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

server = module_server("--profile", "ci")

MODEL = "dummy:tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
SEEDED = {"temperature": 1.0, "seed": 7}
"""Varied text (temperature 0 repeats one token on dummy:tiny), the same on every run."""


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no free keys: the JSON always finishes
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def record(server, body: dict):
    """POST a streamed body; its parsed events and the recorded stream."""
    recorder = SSERecorder()
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        for chunk in response.iter_bytes():
            recorder.feed(chunk)
    stream = recorder.stream()
    return [json.loads(e.data) for e in stream.events], stream


def test_created_and_streamed_agree(client):
    whole = client.responses.create(model=MODEL, input="hello", max_output_tokens=16,
                                    extra_body=SEEDED)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 16 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + 16
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete" and len(whole.output_text) > 0
    assert whole.id.startswith("resp_") and whole.max_output_tokens == 16

    events = list(client.responses.create(model=MODEL, input="hello", max_output_tokens=16,
                                          stream=True, extra_body=SEEDED))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_a_raw_stream_passes_the_checker(server):
    events, stream = record(server, {"model": MODEL, "input": "hi", "max_output_tokens": 24,
                                     "instructions": "Be brief.", **SEEDED})
    report = check_streams([stream])
    assert report.ok, report.summary()
    checked = report.streams[0]
    assert checked.status == "complete" and len(checked.token_ids) == 24
    assert checked.request_id == events[0]["response"]["id"]
    assert checked.text == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["instructions"] == "Be brief."


def test_forced_call_streams_and_round_trips(client, server):
    body = {"model": MODEL, "input": "weather in Paris?", "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 200, **SEEDED}
    events, stream = record(server, body)
    report = check_streams([stream])  # the markup's tokens ride on the call's events
    assert report.ok and report.streams[0].status == "complete", report.summary()
    types = [e["type"] for e in events]
    assert types[2] == "response.output_item.added"
    assert events[2]["item"]["type"] == "function_call"
    assert events[2]["item"]["name"] == "get_weather"
    assert types[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    arguments = "".join(e["delta"] for e in events
                        if e["type"] == "response.function_call_arguments.delta")
    [call] = events[-1]["response"]["output"]
    assert call["arguments"] == arguments == events[-3]["arguments"]
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    assert call["call_id"].startswith("call_") and call["status"] == "completed"

    # The call and its output go back as history; the model answers in text (tools auto).
    answer = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21C"}],
        extra_body=SEEDED)
    assert answer.output[0].type in ("message", "function_call")
    bare = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8,
                                   input="weather in Paris?", extra_body=SEEDED)
    assert answer.usage.input_tokens > bare.usage.input_tokens  # the history was shown


def test_named_call_and_parsed_schema(client):
    named = client.responses.create(model=MODEL, input="weather?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=200, extra_body=SEEDED)
    assert [item.type for item in named.output] == ["function_call"]
    jsonschema.validate(json.loads(named.output[0].arguments), WEATHER["parameters"])

    parsed = client.responses.parse(model=MODEL, input="a city", text_format=City,
                                    max_output_tokens=200, extra_body=SEEDED)
    assert isinstance(parsed.output_parsed, City) and parsed.status == "completed"
    assert parsed.text.format.type == "json_schema"
    # The SDK's stream helper rebuilds the response from the events, checking their order
    # (it takes only a response.completed as the end: OpenAI's own response.incomplete, for
    # a cut output, makes its get_final_response raise).
    with client.responses.stream(model=MODEL, input="a city", text_format=City,
                                 max_output_tokens=200, extra_body=SEEDED) as stream:
        list(stream)
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


def test_logprobs_streamed_and_not(client, server):
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 10, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"], **SEEDED}
    whole = client.responses.create(**{k: v for k, v in body.items() if k not in SEEDED},
                                    extra_body=SEEDED)
    entries = whole.output[0].content[0].logprobs
    assert len(entries) == 10 and all(len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == whole.output_text
    events, _ = record(server, body)
    streamed = [entry for e in events if e["type"] == "response.output_text.delta"
                for entry in e["logprobs"]]
    assert [e["token"] for e in streamed] == [e.token for e in entries]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == streamed


def test_stored_responses_continue_list_and_delete(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ann.", max_output_tokens=8,
                                    extra_body=SEEDED)
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8,
                                     previous_response_id=first.id, extra_body=SEEDED)
    assert second.previous_response_id == first.id
    # The model was shown the first turn, its answer, then the new input: the prompt is
    # exactly the chat of those three messages.
    chat = [{"role": "user", "content": "My name is Ann."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}]
    counted = httpx.post(server.url + "/tokenize", json={"messages": chat}, timeout=30).json()
    assert second.usage.input_tokens == counted["count"]

    assert client.responses.retrieve(second.id).output_text == second.output_text
    newest_first = client.responses.input_items.list(second.id)
    assert [(i.type, i.role) for i in newest_first.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert newest_first.data[1].id == first.output[0].id
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in newest_first.data[::-1][:2]]
    assert page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.last_id)
    assert [i.id for i in rest.data] == [newest_first.data[0].id] and not rest.has_more

    # Streamed responses are stored too, and continue from a stored one.
    events = list(client.responses.create(model=MODEL, input="Again?", max_output_tokens=4,
                                          previous_response_id=second.id, stream=True,
                                          extra_body=SEEDED))
    third = client.responses.retrieve(events[-1].response.id)
    assert third.output_text == events[-1].response.output_text
    assert len(client.responses.input_items.list(third.id).data) == 5

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert client.responses.retrieve(second.id).id == second.id  # the rest stay
    unstored = client.responses.create(model=MODEL, input="x", store=False,
                                       max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    kept = {line.split()[0]: float(line.split()[1])
            for line in httpx.get(server.url + "/metrics").text.splitlines()
            if line.startswith("tokstream_stored_conversation")}
    assert kept["tokstream_stored_conversations"] >= 2
    assert kept["tokstream_stored_conversation_bytes"] > 0


@pytest.mark.parametrize("extra, field", [
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"include": ["everything"]}, "include.0"),
    ({"temperature": -1}, "temperature"),
])
def test_refused_fields_are_a_400_naming_them(server, extra, field):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(field + ":"), error


def test_the_load_generators_responses_requests(server):
    """`tokstream loadtest --api responses` sends this body and reads this stream."""
    from tokstream.loadgen.stream import auth_headers, request_body, stream_request

    body = request_body("responses", MODEL, "hello there", "Be brief.", 12, 1.0, True)
    assert body["store"] is False and body["max_output_tokens"] == 12
    with httpx.Client(timeout=60) as http:
        sample = stream_request(http, server.url, "responses", body,
                                auth_headers("responses", None), 60)
    assert sample["status"] == "ok" and not sample["integrity"], sample
    assert sample["output_tokens"] == sample["tokens_counted"] == 12
    assert sample["input_tokens"] > 0 and sum(sample["event_tokens"]) == 12


def test_the_same_conversation_samples_the_same_tokens_as_on_chat(server):
    """instructions + input items make the prompt chat's messages make: under one seed the
    two routes sample the same tokens, a tool call's history included."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    responses_body = {"model": MODEL, "instructions": "Be brief.", "tools": [WEATHER],
                      "max_output_tokens": 12, **SEEDED, "input": [
                          {"role": "user", "content": "weather in Paris?"}, call,
                          {"type": "function_call_output", "call_id": "call_1",
                           "output": "sunny"}]}
    chat_body = {"model": MODEL, "max_tokens": 12, **SEEDED, "tools": [
        {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                 "parameters")}}],
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    answered = httpx.post(server.url + "/v1/responses", json=responses_body, timeout=60).json()
    chatted = httpx.post(server.url + "/v1/chat/completions", json=chat_body, timeout=60).json()
    assert answered["usage"]["input_tokens"] == chatted["usage"]["prompt_tokens"]
    assert answered["tokstream"]["token_ids"] == chatted["tokstream"]["token_ids"]
