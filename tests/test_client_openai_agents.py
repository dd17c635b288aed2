"""The OpenAI Agents SDK (openai-agents) on OpenAIResponsesModel against a real `tokstream
serve` on dummy:tiny, through POST /v1/responses: an agent loop that forces a function call,
runs the tool, sends its output back as function_call / function_call_output items and ends
on the model's text, run and streamed alike under a seed; the same loop kept on the server with
previous_response_id (the SDK's auto_previous_response_id); and an output_type parsed into a
pydantic model."""

import asyncio
from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers.clients import offline_env, recorder  # noqa: F401 (fixtures)
from helpers.serving import module_server

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

server = module_server("--profile", "ci")


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no free keys: the JSON always finishes
    name: str = Field(max_length=12)


def run(server, recorder, check) -> None:
    """`await check(model)` in one event loop, on a client that records what it sends."""
    # imported here, not at collection: make test-fast collects this file and runs none of it
    from agents import OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces would go to OpenAI

    async def main():
        async with httpx.AsyncClient(event_hooks={"request": [recorder.hook]}) as http:
            client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                 http_client=http, max_retries=0)
            await check(OpenAIResponsesModel(model="dummy:tiny", openai_client=client))

    asyncio.run(main())


def weather_agent(model, cities: list[str]):
    """An agent with one tool, which records the cities it is called with."""
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny, 21C"

    # Forced on the first turn only (the SDK resets tool_choice once a tool has run), one
    # call, a seed (an extra: the Responses API has none) so runs sample alike.
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                             temperature=1.0, extra_body={"seed": 7})
    return Agent(name="weather", instructions="Answer with the weather.", model=model,
                 tools=[get_weather], model_settings=settings)


def test_a_tool_loop_run_and_streamed(server, recorder):
    from agents import Runner

    cities = []

    async def check(model):
        agent = weather_agent(model, cities)
        result = await Runner.run(agent, "weather in Paris?", max_turns=3)
        assert isinstance(result.final_output, str) and result.final_output
        assert len(cities) == 1 and len(recorder.bodies) == 2
        first, second = recorder.bodies
        assert first["tool_choice"] == "required" and first["instructions"]
        history = second["input"]
        assert [item.get("type", "message") for item in history] == [
            "message", "function_call", "function_call_output"]
        assert history[1]["call_id"] == history[2]["call_id"]
        assert history[2]["output"] == "sunny, 21C"

        streamed = Runner.run_streamed(agent, "weather in Paris?", max_turns=3)
        kinds = {event.type async for event in streamed.stream_events()}
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        assert streamed.final_output == result.final_output
        assert cities[1] == cities[0] and len(recorder.bodies) == 4

    run(server, recorder, check)


def test_a_tool_loop_kept_on_the_server(server, recorder):
    from agents import Runner

    cities = []

    async def check(model):
        agent = weather_agent(model, cities)
        whole = await Runner.run(agent, "weather in Paris?", max_turns=3)
        kept = await Runner.run(agent, "weather in Paris?", max_turns=3,
                                auto_previous_response_id=True)
        # The second turn sends only the tool's output, naming the response it follows.
        first, second = recorder.bodies[2:]
        assert "previous_response_id" not in first
        assert [item.get("type") for item in second["input"]] == ["function_call_output"]
        assert kept.final_output == whole.final_output  # the server rebuilt the same prompt
        stored = httpx.get(f"{server.url}/v1/responses/{kept.last_response_id}/input_items",
                           params={"order": "asc"}).json()["data"]
        assert [item["type"] for item in stored] == [
            "message", "function_call", "function_call_output"]
        followed = httpx.get(f"{server.url}/v1/responses/{second['previous_response_id']}")
        assert followed.json()["output"] == [stored[1]]  # the call, as the first turn made it

    run(server, recorder, check)


def test_output_type(server, recorder):
    from agents import Agent, ModelSettings, Runner

    async def check(model):
        agent = Agent(name="city", model=model, output_type=City, model_settings=ModelSettings(
            max_tokens=100, temperature=1.0, extra_body={"seed": 7}))
        result = await Runner.run(agent, "a city")
        assert isinstance(result.final_output, City)
        (sent,) = recorder.bodies
        assert sent["text"]["format"]["type"] == "json_schema"

    run(server, recorder, check)
