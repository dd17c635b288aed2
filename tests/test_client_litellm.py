"""litellm against a real `tokstream serve` on dummy:tiny, through both of its routes to the
server: `openai/` (POST /v1/chat/completions) and `anthropic/` (POST /v1/messages). Streamed
and not, the text agrees under a seed, and the two routes agree with each other (one prompt
template, one sampler); `response_format` with a pydantic model (litellm sends it as
json_schema to OpenAI and as a forced tool to Anthropic) parses on both."""

import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers.clients import offline
from helpers.serving import module_server

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

server = module_server("--profile", "ci")

MESSAGES = [{"role": "user", "content": "hello"}]


class City(BaseModel):
    # Bounded: no extra keys (a schema that allows them lets the model add keys until
    # max_tokens) and a name of at most 12 characters, so 200 tokens always finish the JSON.
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)


@pytest.fixture
def litellm(monkeypatch):
    # imported here, not at collection (make test-fast collects this file and runs none of
    # it), and offline: imported without LITELLM_LOCAL_MODEL_COST_MAP it fetches its cost map
    offline(monkeypatch)
    import litellm

    monkeypatch.setattr(litellm, "suppress_debug_info", True)
    return litellm


def route(server, provider: str) -> dict:
    # `seed` is no Anthropic parameter to litellm: allowed_openai_params passes it on (its
    # extra_body would arrive as a literal "extra_body" key on /v1/messages).
    return {"model": f"{provider}/dummy:tiny", "api_key": "unused", "num_retries": 0,
            "api_base": server.url + "/v1" if provider == "openai" else server.url,
            "temperature": 1, "seed": 7, "allowed_openai_params": ["seed"]}


def streamed_text(chunks) -> tuple[str, object]:
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, getattr(chunks[-1], "usage", None)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_completion_streamed_and_not(litellm, server, provider):
    whole = litellm.completion(messages=MESSAGES, max_tokens=16, **route(server, provider))
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16
    text, usage = streamed_text(litellm.completion(
        messages=MESSAGES, max_tokens=16, stream=True, stream_options={"include_usage": True},
        **route(server, provider)))
    assert text == whole.choices[0].message.content and len(text) > 16
    assert usage.completion_tokens == 16
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_both_routes_give_the_same_text(litellm, server):
    texts = {provider: litellm.completion(messages=MESSAGES, max_tokens=16,
                                          **route(server, provider)).choices[0].message.content
             for provider in ("openai", "anthropic")}
    assert texts["openai"] == texts["anthropic"]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_response_format_pydantic_model(litellm, server, provider):
    reply = litellm.completion(messages=[{"role": "user", "content": "a city"}],
                               max_tokens=200, response_format=City,
                               **route(server, provider))
    assert reply.choices[0].finish_reason == "stop"
    city = City.model_validate_json(reply.choices[0].message.content)
    assert len(city.name) <= 12
