"""pydantic-ai's Agent on OpenAIChatModel and on OpenAIResponsesModel (POST /v1/responses)
against a real `tokstream serve` on dummy:tiny: a structured output as its output tool
(tool_choice "required", the call's arguments streamed and not) and as NativeOutput
(response_format / text.format json_schema), parsed into a pydantic model with
maxLength-bounded fields; plain text run and streamed agree under a seed."""

import asyncio

import httpx2
import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers.clients import offline_env, recorder  # noqa: F401 (fixtures)
from helpers.serving import module_server

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

server = module_server("--profile", "ci")

# One call per turn: with parallel calls the grammar lets the model add calls until max_tokens.
# The seed goes in extra_body: the Responses API has none (the server reads it as on chat).
SETTINGS = {"temperature": 1.0, "extra_body": {"seed": 7}, "max_tokens": 200,
            "parallel_tool_calls": False}
APIS = ["chat", "responses"]
"""The API the model speaks: OpenAIChatModel or OpenAIResponsesModel."""


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no free keys: the JSON always finishes
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


def run(server, recorder, check, api: str) -> None:
    """`await check(model)` in one event loop, on a client that records what it sends."""
    # imported here, not at collection: make test-fast collects this file and runs none of it
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def main():
        async with httpx2.AsyncClient(event_hooks={"request": [recorder.hook]}) as http:
            provider = OpenAIProvider(base_url=server.url + "/v1", api_key="unused",
                                      http_client=http)
            model = OpenAIResponsesModel if api == "responses" else OpenAIChatModel
            await check(model("dummy:tiny", provider=provider))
        assert all(("input" in body) == (api == "responses") for body in recorder.bodies)

    asyncio.run(main())


def last_response(result):
    return [m for m in result.all_messages() if type(m).__name__ == "ModelResponse"][-1]


@pytest.mark.parametrize("api", APIS)
def test_tool_output_streamed_and_not(server, recorder, api):
    from pydantic_ai import Agent

    async def check(model):
        agent = Agent(model, output_type=City, model_settings=SETTINGS, retries=0)
        result = await agent.run("a city")
        assert isinstance(result.output, City)
        # pydantic-ai reads a Responses API answer's finish from its status: completed
        assert last_response(result).finish_reason == ("stop" if api == "responses"
                                                       else "tool_call")
        sent = recorder.bodies[0]
        assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
        async with agent.run_stream("a city") as streamed:
            partial = [output async for output in streamed.stream_output(debounce_by=None)]
            assert await streamed.get_output() == result.output  # one seed, one call
        assert len(partial) > 1  # the arguments arrived in pieces

    run(server, recorder, check, api)


@pytest.mark.parametrize("api", APIS)
def test_native_output(server, recorder, api):
    from pydantic_ai import Agent, NativeOutput

    async def check(model):
        agent = Agent(model, output_type=NativeOutput(City), model_settings=SETTINGS,
                      retries=0)
        result = await agent.run("a city")
        assert isinstance(result.output, City)
        assert last_response(result).finish_reason == "stop"
        (sent,) = recorder.bodies
        schema = sent["text"]["format"] if api == "responses" else sent["response_format"]
        assert schema["type"] == "json_schema"

    run(server, recorder, check, api)


@pytest.mark.parametrize("api", APIS)
def test_text_run_and_stream_agree(server, recorder, api):
    from pydantic_ai import Agent

    async def check(model):
        agent = Agent(model, model_settings={**SETTINGS, "max_tokens": 16})
        whole = await agent.run("hello")
        assert whole.usage.output_tokens == 16
        async with agent.run_stream("hello") as streamed:
            deltas = [delta async for delta in streamed.stream_text(delta=True)]
        assert "".join(deltas) == whole.output and len(whole.output) > 16

    run(server, recorder, check, api)
