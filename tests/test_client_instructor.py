"""instructor against a real `tokstream serve` on dummy:tiny, in the modes that work with a
server that constrains its output (the model is gibberish, so only a grammar makes the JSON
valid): `from_openai` in Mode.JSON_SCHEMA (`response_format` json_schema) and Mode.TOOLS (a
forced tool call), `from_anthropic` in Mode.TOOLS (a forced `tool_use`, /v1/messages; the
Mode.ANTHROPIC_TOOLS of older releases, deprecated in 1.17).
Each returns a validated pydantic model with the usage the server counted; `create_partial`
streams partial models (parsed by jiter as the pieces come) ending at what the same request
gives unstreamed; a validator that rejects the first answer makes instructor re-ask with the
failed call and its error in the history (a `tool` message, a `tool_result` block).

instructor 1.17.0 is installed with --no-deps (deploy/lock/instructor.txt): it declares
jiter<0.15 and rich<15, and the lock's openai 3.57.0 needs jiter>=0.16; these tests show it
works with the lock's jiter 0.19 (which parses the partial streams) and rich 15 (imported only
by its CLI, not used here). Left out, as nothing constrains the
output to the schema there and dummy:tiny writes `{}` or gibberish: Mode.JSON (`json_object`,
the schema only in the system prompt), Mode.ANTHROPIC_JSON (free text), and from_anthropic's
Mode.JSON_SCHEMA (it looks for an `output_format` argument, which anthropic 2.14's
messages.create lacks, and falls back to Mode.ANTHROPIC_JSON's prompt)."""

import json

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from helpers.clients import offline_env, recorder  # noqa: F401 (fixtures)
from helpers.serving import module_server

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

server = module_server("--profile", "ci")

# temperature 1 with a seed: varied text (temperature 0 repeats one token), reproducible.
# A forced call's markup and JSON take ~100 tokens on dummy:tiny; 200 always finish it.
ASK = {"model": "dummy:tiny", "messages": [{"role": "user", "content": "a city"}],
       "max_tokens": 200, "max_retries": 0}
OPENAI_SAMPLING = {"temperature": 1, "seed": 7}
# anthropic 2.14's messages.create takes no temperature (nor seed, an extension): the body.
ANTHROPIC_SAMPLING = {"extra_body": {"temperature": 1, "seed": 7}}


class City(BaseModel):
    # Bounded: no extra keys (a schema that allows them lets the model add keys until
    # max_tokens) and names of at most 12 characters, so 200 tokens always finish the JSON.
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


class PickyCity(City):
    """Rejects a name listed in the validation context (instructor's `context=`), so the first
    answer fails and instructor re-asks."""

    @field_validator("name")
    @classmethod
    def not_rejected(cls, name: str, info: ValidationInfo) -> str:
        rejected = (info.context or {}).get("rejected")
        if rejected is not None and not rejected:
            rejected.append(name)
            raise ValueError("not a city name")
        return name


@pytest.fixture
def openai_client(server, recorder):
    from openai import OpenAI

    with httpx.Client(event_hooks={"request": [recorder]}) as http:
        yield OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http,
                     max_retries=0)


@pytest.fixture
def anthropic_client(server, recorder):
    import httpx2  # what anthropic 2.14 runs on (it refuses an httpx.Client)
    from anthropic import Anthropic

    with httpx2.Client(event_hooks={"request": [recorder]}) as http:
        yield Anthropic(base_url=server.url, api_key="unused", http_client=http, max_retries=0)


def assert_grows_into(partials: list, final: dict) -> None:
    """The partial models came in pieces, each field None or a prefix of its final value, and
    the last is the final object. (instructor's models are subclasses of the one it is given:
    they compare as dicts.)"""
    assert len(partials) > 2
    for partial in partials:
        for field in ("name", "country"):
            value = getattr(partial, field)
            assert value is None or final[field].startswith(value), (partial, final)
    assert partials[-1].model_dump() == final
    City.model_validate(final)


def test_json_schema_mode_create_and_partial(openai_client, recorder):
    import instructor

    client = instructor.from_openai(openai_client, mode=instructor.Mode.JSON_SCHEMA)
    city, completion = client.chat.completions.create_with_completion(
        response_model=City, **ASK, **OPENAI_SAMPLING)
    assert isinstance(city, City)
    (sent,) = recorder.bodies
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"]["additionalProperties"] is False
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert json.loads(choice.message.content) == city.model_dump()
    usage = completion.usage
    assert 0 < usage.completion_tokens < 200
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The prompt is the user turn alone: json_schema mode puts nothing in it.
    plain = openai_client.chat.completions.create(
        model="dummy:tiny", messages=ASK["messages"], max_tokens=1)
    assert usage.prompt_tokens == plain.usage.prompt_tokens

    # Streamed: the schema's name is PartialCity, but the name is not in the prompt and the
    # grammar is the same, so under the same seed the stream ends at the same City.
    recorder.bodies.clear()
    partials = list(client.chat.completions.create_partial(
        response_model=City, **ASK, **OPENAI_SAMPLING))
    assert recorder.bodies[0]["stream"] is True
    assert_grows_into(partials, city.model_dump())


def test_tools_mode_create_and_partial(openai_client, recorder):
    import instructor

    client = instructor.from_openai(openai_client, mode=instructor.Mode.TOOLS)
    city, completion = client.chat.completions.create_with_completion(
        response_model=City, **ASK, **OPENAI_SAMPLING)
    assert isinstance(city, City)
    (sent,) = recorder.bodies
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "City"
    assert json.loads(call.function.arguments) == city.model_dump()
    assert not choice.message.content  # no markup reached the text
    usage = completion.usage
    assert 0 < usage.completion_tokens < 200
    plain = openai_client.chat.completions.create(
        model="dummy:tiny", messages=ASK["messages"], max_tokens=1)
    assert usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tool is in the prompt

    # Streamed the tool is PartialCity (a different prompt): the stream ends at what that
    # same request gives unstreamed.
    recorder.bodies.clear()
    partials = list(client.chat.completions.create_partial(
        response_model=City, **ASK, **OPENAI_SAMPLING))
    (streamed,) = recorder.bodies
    assert streamed.pop("stream") is True
    assert streamed["tool_choice"]["function"]["name"] == "PartialCity"
    whole = openai_client.chat.completions.create(**streamed)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert_grows_into(partials,
                      json.loads(whole.choices[0].message.tool_calls[0].function.arguments))


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_reask_after_a_validation_error(openai_client, recorder, mode):
    import instructor

    client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
    rejected: list[str] = []
    city, completion = client.chat.completions.create_with_completion(
        response_model=PickyCity, context={"rejected": rejected},
        **{**ASK, "max_retries": 1}, **OPENAI_SAMPLING)
    assert isinstance(city, PickyCity) and len(rejected) == 1
    first, second = recorder.bodies
    history = second["messages"]
    assert history[0] == first["messages"][0] and len(history) == 3
    if mode == "TOOLS":
        # The failed call goes back as the assistant's tool call, the error as its result.
        (call,) = history[1]["tool_calls"]
        assert json.loads(call["function"]["arguments"])["name"] == rejected[0]
        assert history[2]["role"] == "tool" and history[2]["tool_call_id"] == call["id"]
        assert "not a city name" in history[2]["content"]
        assert completion.choices[0].finish_reason == "tool_calls"
        answer = completion.choices[0].message.tool_calls[0].function.arguments
    else:
        assert json.loads(history[1]["content"])["name"] == rejected[0]
        assert history[2]["role"] == "user" and "not a city name" in history[2]["content"]
        assert completion.choices[0].finish_reason == "stop"
        answer = completion.choices[0].message.content
    assert json.loads(answer) == city.model_dump()  # the second answer, validated
    # instructor sums the attempts' usage. The first request again (one seed, one answer)
    # counts the first attempt: the second prompt holds the first with its answer and error.
    usage, again = completion.usage, openai_client.chat.completions.create(**first).usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens - again.prompt_tokens > again.prompt_tokens
    assert 0 < usage.completion_tokens - again.completion_tokens < 200


def test_anthropic_tools_create_and_partial(anthropic_client, recorder):
    import instructor

    client = instructor.from_anthropic(anthropic_client, mode=instructor.Mode.TOOLS)
    city, message = client.messages.create_with_completion(
        response_model=City, **ASK, **ANTHROPIC_SAMPLING)
    assert isinstance(city, City)
    (sent,) = recorder.bodies
    assert sent["tool_choice"]["type"] == "tool" and sent["tool_choice"]["name"] == "City"
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.input == city.model_dump()
    usage = message.usage
    assert 0 < usage.output_tokens < 200
    # The prompt as the server split it (uncached, read, written) is what count_tokens counts.
    counted = anthropic_client.messages.count_tokens(
        model="dummy:tiny", messages=sent["messages"], tools=sent["tools"],
        tool_choice=sent["tool_choice"])
    assert counted.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                    + usage.cache_creation_input_tokens)

    recorder.bodies.clear()
    partials = list(client.messages.create_partial(
        response_model=City, **ASK, **ANTHROPIC_SAMPLING))
    (streamed,) = recorder.bodies
    assert streamed.pop("stream") is True
    assert streamed["tool_choice"]["name"] == "PartialCity"
    extra = {name: streamed.pop(name) for name in ANTHROPIC_SAMPLING["extra_body"]}
    whole = anthropic_client.messages.create(**streamed, extra_body=extra)
    assert whole.stop_reason == "tool_use"
    assert_grows_into(partials, whole.content[0].input)


def test_anthropic_reask_after_a_validation_error(anthropic_client, recorder):
    import instructor

    client = instructor.from_anthropic(anthropic_client, mode=instructor.Mode.TOOLS)
    rejected: list[str] = []
    city, message = client.messages.create_with_completion(
        response_model=PickyCity, context={"rejected": rejected},
        **{**ASK, "max_retries": 1}, **ANTHROPIC_SAMPLING)
    assert isinstance(city, PickyCity) and len(rejected) == 1
    assert message.stop_reason == "tool_use"
    assert message.content[0].input == city.model_dump()  # the second answer, validated
    first, second = recorder.bodies
    user, assistant, result = second["messages"]
    assert user == first["messages"][0]
    (use,) = assistant["content"]
    assert use["type"] == "tool_use" and use["input"]["name"] == rejected[0]
    (block,) = result["content"]
    assert block["type"] == "tool_result" and block["tool_use_id"] == use["id"]
    assert block["is_error"] is True and "not a city name" in block["content"]
