"""The OpenAI sampling surface through the official SDK against a real `tokstream serve`:
logprobs (chat and completions, streamed and not, in the SDK's typed shapes), penalties,
min_p, logit_bias, structured outputs (response_format json_schema / json_object, vLLM's
structured_outputs), cached-token usage, and typed 400s for bad values."""

import json

import jsonschema
import openai
import pytest

from helpers.serving import module_server

pytestmark = pytest.mark.startup  # starts servers or engines (make test-fast leaves it out)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


server = module_server("--profile", "ci", "--model", "smollm2", "--weights", "float32",
                       "--num-blocks", "256")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client, **kwargs):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say something."}],
        max_tokens=kwargs.pop("max_tokens", 8), **kwargs)


def test_chat_logprobs_in_the_sdks_shape(client):
    reply = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.token == bytes(item.bytes).decode("utf-8", errors="replace")
        assert item.logprob == item.top_logprobs[0].logprob  # greedy: the most likely one
    # streamed: the same tokens and values, spread over the chunks (this prompt's KV now
    # comes from the prefix cache, rounded to float16 where the first pass computed it fresh)
    streamed = [c for chunk in chat(client, temperature=0, logprobs=True, top_logprobs=3,
                                    stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 0.01


def chat_entries_and_content(client, stream: bool, **kwargs):
    """(logprobs.content entries, message content, the choice's end) of one chat answer."""
    reply = chat(client, temperature=0, logprobs=True, top_logprobs=2, stream=stream, **kwargs)
    if not stream:
        choice = reply.choices[0]
        return choice.logprobs.content, choice.message.content, (choice.finish_reason,
                                                                 reply.usage)
    entries, content, finish = [], "", None
    for chunk in reply:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            entries += choice.logprobs.content if choice.logprobs else []
            finish = choice.finish_reason or finish
    return entries, content, (finish, None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("stop, content", [(None, "Paris is lovely."), (" is", "Paris"),
                                           ("ari", "P")], ids=["eos", "stop", "stop-in-a-token"])
def test_chat_logprobs_add_up_to_the_content(client, stream, stop, content):
    # The grammar ends the turn, so the model's last token is <|im_end|>, which the content
    # never shows; a stop string's tokens are not shown either ("ari" cuts the token "Paris").
    entries, text, (finish, usage) = chat_entries_and_content(
        client, stream, max_tokens=16, stop=stop,
        extra_body={"structured_outputs": {"regex": "Paris is lovely\\."}})
    assert text == content and finish == "stop"
    assert "".join(e.token for e in entries) == content
    assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
    assert all("<|im_end|>" != e.token and e.logprob <= 0 for e in entries)
    if usage is not None and stop is None:
        assert usage.completion_tokens == len(entries) + 1  # the end-of-turn token


def test_completions_logprobs(client):
    reply = client.completions.create(model="smollm2", prompt="The capital of France is",
                                      max_tokens=5, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_no_logprobs_unless_asked(client):
    assert chat(client, temperature=0).choices[0].logprobs is None


def test_logit_bias_and_penalties_change_the_output(client):
    plain = chat(client, temperature=0, max_tokens=12)
    biased = chat(client, temperature=0, max_tokens=12, logit_bias={"42": 100})
    assert biased.choices[0].message.content != plain.choices[0].message.content
    penalised = chat(client, temperature=0.8, seed=3, max_tokens=12, frequency_penalty=2.0,
                     presence_penalty=2.0, extra_body={"repetition_penalty": 1.5, "min_p": 0.1})
    assert penalised.usage.completion_tokens >= 1


def test_response_format_json_schema_and_object(client):
    reply = chat(client, temperature=1.0, seed=5, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    choice = chat(client, temperature=1.0, seed=5, max_tokens=10,
                  extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert choice.choices[0].message.content in ("red", "blue")


def test_cached_tokens_in_usage(client):
    messages = [{"role": "user", "content": "A long shared preamble. " * 20}]
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
    # The template's system prompt is cached from the earlier tests already; the preamble
    # only for the second request.
    before = first.usage.prompt_tokens_details.cached_tokens
    after = second.usage.prompt_tokens_details.cached_tokens
    assert after >= before + 64 and after < second.usage.prompt_tokens


@pytest.mark.parametrize("kwargs,field", [
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ({"logit_bias": {"5": 500}}, "logit_bias.5"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"n": 17}, "n"),  # 1-16 are served (n choices)
])
def test_bad_values_are_typed_400s(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, **kwargs)
    assert raised.value.body["param"] == field


def test_anthropic_usage_counts_the_prefix_cache(server):
    """The Messages API's usage from the prefix cache's real hits, through the official SDK;
    cache_control is accepted (caching is automatic)."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    system = [{"type": "text", "text": "You answer briefly. " * 30,
               "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "Hello"}]
    first = client.messages.create(model="smollm2", max_tokens=2, system=system,
                                   messages=messages)
    second = client.messages.create(model="smollm2", max_tokens=2, system=system,
                                    messages=messages)
    total = lambda u: (u.input_tokens + u.cache_read_input_tokens  # noqa: E731
                       + u.cache_creation_input_tokens)
    assert total(first.usage) == total(second.usage)
    assert second.usage.cache_read_input_tokens >= first.usage.cache_read_input_tokens + 64
    assert first.usage.cache_creation_input_tokens >= 64
    assert second.usage.cache_creation_input_tokens < first.usage.cache_creation_input_tokens
