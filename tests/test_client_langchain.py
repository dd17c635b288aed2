"""langchain-openai's ChatOpenAI against a real `tokstream serve` on dummy:tiny (the model's
quality does not matter here; its output is gibberish, the server's framing is what is
checked): invoke and stream agree token for token under a seed, usage arrives on the stream,
bind_tools round-trips a forced call through a history whose earlier call has broken JSON
arguments, and with_structured_output parses a maxLength-bounded schema; and the same with
use_responses_api (POST /v1/responses)."""

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers.clients import offline_env, recorder  # noqa: F401 (fixtures)
from helpers.serving import module_server

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

server = module_server("--profile", "ci")


class GetWeather(BaseModel):
    """Get the weather in a city."""

    model_config = ConfigDict(extra="forbid")  # no free keys: the JSON always finishes
    city: str = Field(max_length=12)


@pytest.fixture
def chat(server, recorder):
    # imported here, not at collection: make test-fast collects this file and runs none of it
    from langchain_openai import ChatOpenAI

    with httpx.Client(event_hooks={"request": [recorder]}) as http:
        # temperature 1 with a seed: varied text (temperature 0 repeats one token), reproducible
        yield ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="dummy:tiny",
                         temperature=1, seed=7, max_tokens=16, max_retries=0,
                         stream_usage=True, http_client=http)


def test_invoke_and_stream_agree(chat):
    whole = chat.invoke("hello")
    assert whole.response_metadata["finish_reason"] == "length"
    assert whole.usage_metadata["output_tokens"] == 16
    chunks = list(chat.stream("hello"))
    assert len(chunks) > 2
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.content == whole.content and len(whole.content) > 16
    assert streamed.usage_metadata["output_tokens"] == 16
    assert streamed.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"]


def test_bind_tools_round_trip_with_broken_arguments_in_the_history(chat, recorder):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    # The forced call's markup and JSON take ~80 tokens on the byte-level tokenizer.
    tools = chat.bind_tools([GetWeather], tool_choice="GetWeather").bind(max_tokens=200)
    history = [
        HumanMessage("weather in Paris?"),
        AIMessage(content="", invalid_tool_calls=[{
            "type": "invalid_tool_call", "name": "GetWeather", "args": '{"city": "Par',
            "id": "call_1", "error": "the model stopped mid-JSON"}]),
        ToolMessage("no such city", tool_call_id="call_1"),
        HumanMessage("try again"),
    ]
    reply = tools.invoke(history)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and not reply.invalid_tool_calls
    GetWeather.model_validate(call["args"])
    # the broken arguments reached the server as they were
    (sent,) = recorder.bodies
    assert sent["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    assert sent["tool_choice"]["function"]["name"] == "GetWeather"

    streamed = None
    for chunk in tools.stream(history):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.response_metadata["finish_reason"] == "tool_calls"
    (streamed_call,) = streamed.tool_calls
    assert streamed_call["args"] == call["args"]  # the same seed, the same call


def test_structured_output_json_schema(chat, recorder):
    # 16 tokens may end mid-string; the schema's maxLength bounds what 64 have to hold
    structured = chat.model_copy(update={"max_tokens": 64}).with_structured_output(
        GetWeather, method="json_schema")
    answer = structured.invoke("weather?")
    assert isinstance(answer, GetWeather) and len(answer.city) <= 12
    (sent,) = recorder.bodies
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"]["properties"]["city"]["maxLength"] == 12


def test_responses_api(server, recorder):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    with httpx.Client(event_hooks={"request": [recorder]}) as http:
        # The Responses API has no seed field: the server reads it as a vLLM-style extra.
        chat = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="dummy:tiny",
                          temperature=1, extra_body={"seed": 7}, max_tokens=16, max_retries=0,
                          stream_usage=True, use_responses_api=True, http_client=http)
        whole = chat.invoke("hello")
        assert whole.response_metadata["status"] == "incomplete"
        assert whole.usage_metadata["output_tokens"] == 16
        streamed = None
        for chunk in chat.stream("hello"):
            streamed = chunk if streamed is None else streamed + chunk
        assert streamed.text == whole.text and len(whole.text) > 16
        assert streamed.usage_metadata["output_tokens"] == 16

        tools = chat.model_copy(update={"max_tokens": 200}).bind_tools(
            [GetWeather], tool_choice="GetWeather")
        reply = tools.invoke("weather in Paris?")
        (call,) = reply.tool_calls
        GetWeather.model_validate(call["args"])
        again = tools.invoke([HumanMessage("weather in Paris?"), reply,
                              ToolMessage("sunny", tool_call_id=call["id"]),
                              HumanMessage("and tomorrow?")])
        GetWeather.model_validate(again.tool_calls[0]["args"])
        history = recorder.bodies[-1]["input"]
        assert [item.get("type") for item in history] == [
            "message", "function_call", "function_call_output", "message"]

        structured = chat.model_copy(update={"max_tokens": 64}).with_structured_output(
            GetWeather, method="json_schema")
        assert isinstance(structured.invoke("weather?"), GetWeather)
        assert recorder.bodies[-1]["text"]["format"]["type"] == "json_schema"
