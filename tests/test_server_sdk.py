"""The official `anthropic` and `openai` SDKs against a real `tokstream serve` on the real
SmolLM2 (float32, small max_tokens), streaming and not (chat, completions, the Responses API
with a conversation continued from a stored response), plus the raw stream through the
checker. These load the real model: marked slow, still part of `make test`."""

import anthropic
import httpx
import openai
import pytest

from helpers.serving import ServerProcess, record
from tokstream.checker import check_streams

pytestmark = [pytest.mark.startup, pytest.mark.slow, pytest.mark.timeout(600)]

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", "smollm2", "--dtype", "float32", "--kv-cache-memory",
                       "256MiB", "--max-num-seqs", "8") as server:
        yield server


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def gpt(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def prompt_tokens(usage) -> int:
    """The Messages API counts the prompt in three parts: uncached, read from and written to
    the prefix cache."""
    return (usage.input_tokens + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0))


def test_anthropic_sdk_create_and_stream(claude):
    message = claude.messages.create(
        model="smollm2", max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0})
    assert message.content[0].text == ANSWER
    assert message.stop_reason == "end_turn"
    assert prompt_tokens(message.usage) == 37
    with claude.messages.stream(
            model="smollm2", max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
            extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ANSWER == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert prompt_tokens(final.usage) == 37
    assert final.usage.output_tokens == message.usage.output_tokens

    short = claude.messages.create(
        model="smollm2", max_tokens=3, messages=[{"role": "user", "content": QUESTION}],
        system="Answer in French.", extra_body={"temperature": 0})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_anthropic_sdk_errors_are_typed(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="smollm2", max_tokens=0,
                               messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" in str(raised.value)


def test_openai_sdk_chat_completions_and_stream(gpt):
    messages = [{"role": "user", "content": QUESTION}]
    chat = gpt.chat.completions.create(model="smollm2", messages=messages, max_tokens=16,
                                       temperature=0)
    assert chat.choices[0].message.content == ANSWER
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens == 37
    chunks = list(gpt.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    completion = gpt.completions.create(model="smollm2", prompt="The capital of France is",
                                        max_tokens=4, temperature=0)
    assert completion.choices[0].text.strip().startswith("Paris")
    streamed = "".join(c.choices[0].text for c in gpt.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0,
        stream=True))
    assert streamed == completion.choices[0].text
    assert [m.id for m in gpt.models.list().data] == ["smollm2"]


def test_openai_sdk_responses_on_the_real_model(gpt):
    answer = gpt.responses.create(model="smollm2", input=QUESTION, max_output_tokens=16,
                                  temperature=0)
    assert answer.output_text == ANSWER and answer.status == "completed"
    assert answer.usage.input_tokens == 37  # the prompt chat builds from the same question
    with gpt.responses.stream(model="smollm2", input=QUESTION, max_output_tokens=16,
                              temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == ANSWER == final.output_text
    followed = gpt.responses.create(model="smollm2", input="And of Germany?",
                                    previous_response_id=answer.id, max_output_tokens=16,
                                    temperature=0)
    assert "Berlin" in followed.output_text


def test_raw_streams_on_the_real_model_pass_the_checker(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        _, stream = record(client, "/v1/messages", {
            "model": "smollm2", "max_tokens": 16, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]})
    report = check_streams([stream])
    assert report.ok, report.summary()
    assert report.streams[0].text == ANSWER
    assert report.streams[0].finish_reason == "stop"
