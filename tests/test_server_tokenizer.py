"""POST /tokenize, /detokenize and GET /tokenizer_info against a real `tokstream serve` (SmolLM2's tokenizer on the
tiny model's engine would not matter: ids come from the served model's tokenizer, which
tests/test_tokenizer.py holds to transformers'): vLLM's shapes, the chat template, the
round trip, lm-eval's remote tokenizer, and typed 400s."""

import os

import httpx
import pytest

from helpers.serving import module_server
from tokstream.idle_threads import cpu_ticks, policy, thread_ids
from tokstream.model.presets import dummy_config
from tokstream.model.source import ModelSource, embedded_gguf_path
from tokstream.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.startup  # starts servers or engines (make test-fast leaves it out)


# The embedded GGUF's tokenizer on a tiny random engine: real ids, a fast start.
server = module_server("--profile", "ci", "--model", "smollm2", "--weights", "float32",
                       "--num-blocks", "64")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSource("gguf", embedded_gguf_path(),
                                      dummy_config("smollm2-135m")))


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=30)


def test_a_prompt_is_tokenised_as_the_model_does(server, tokenizer):
    text = "The capital of France is Paris. 12345 naïve 😀"
    reply = post(server, "/tokenize", {"prompt": text})
    assert reply.status_code == 200
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": text}


def test_messages_go_through_the_chat_template(server, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with_prompt = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert with_prompt == tokenizer.encode_chat(messages)
    without = post(server, "/tokenize", {"messages": messages,
                                         "add_generation_prompt": False}).json()["tokens"]
    assert without == tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert len(without) < len(with_prompt)
    text = post(server, "/detokenize", {"tokens": with_prompt}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n")


def test_a_tool_history_without_content_tokenises_with_and_without_a_generation_prompt(
        server, tokenizer):
    # An assistant turn of calls only (no content), arguments a model cut short: no 500, and
    # the turn is in the prompt as the chat route shows it, the call as it was written.
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    without = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert without.status_code == 200, without.text
    with_prompt = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    text = tokenizer.decode(without.json()["tokens"], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>' \
        in text and "21 C" in text
    assert with_prompt[:len(without.json()["tokens"])] == without.json()["tokens"]
    assert tokenizer.decode(with_prompt, skip_special_tokens=False) == \
        text + "<|im_start|>assistant\n"


def test_continue_final_message_leaves_the_assistant_turn_open(server, tokenizer):
    """vLLM's chat extension (a prefill on the OpenAI route): the last assistant message is
    continued, not closed and answered; the chat route samples from exactly those ids."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": messages, "continue_final_message": True,
            "add_generation_prompt": False}
    ids = post(server, "/tokenize", body).json()["tokens"]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    assert ids[:len(tokenizer.encode_chat(messages[:1]))] == tokenizer.encode_chat(messages[:1])
    sampling = {"model": "smollm2", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = post(server, "/v1/chat/completions", {**body, **sampling}).json()
    plain = post(server, "/v1/completions", {"prompt": ids, **sampling}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["tokstream"]["token_ids"] == plain["tokstream"]["token_ids"]
    closed = post(server, "/tokenize", {"messages": messages})
    assert closed.json()["tokens"] != ids  # by default the turn is closed and answered


@pytest.mark.parametrize("extra, words", [
    ({"continue_final_message": True}, "add_generation_prompt: false"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "hi"}]}, "from the assistant"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "response_format": {"type": "json_object"}}, "structured output"),
    ({"continue_final_message": "yes", "add_generation_prompt": False}, "boolean"),
])
def test_continue_final_message_refusals_name_it(server, extra, words):
    body = {"model": "smollm2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "Hello"}], **extra}
    reply = post(server, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "continue_final_message" and words in error["message"], error


def test_chat_template_kwargs_go_to_the_template(server, tokenizer):
    """SmolLM2's template reads no further variables: kwargs it does not know change nothing
    (as with transformers); what the render sets itself, or a template of the caller's own,
    is refused (tests/test_tokenizer.py shows kwargs reaching a template that reads them)."""
    messages = [{"role": "user", "content": "hi"}]
    plain = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    given = post(server, "/tokenize", {"messages": messages,
                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert given.json()["tokens"] == plain
    reply = post(server, "/v1/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(plain)
    for extra, field in (({"chat_template_kwargs": {"messages": []}},
                          "chat_template_kwargs.messages"),
                         ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
                         ({"chat_template": "{{ messages }}"}, "chat_template")):
        refused = post(server, "/v1/chat/completions", {
            "model": "smollm2", "messages": messages, "max_tokens": 2, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_lm_evals_remote_tokenizer_reads_the_served_one(server, tokenizer):
    """GET /tokenizer_info (vLLM's): lm-eval's `local-completions` then tokenises through the
    server (tokenizer_backend auto picks `remote`), with the served chat template."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == \
        (tokenizer.eos_token, tokenizer.bos_token, 8192)
    assert info["chat_template"] == tokenizer.chat_template
    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = RemoteTokenizer(server.url + "/v1/completions")
    assert remote.eos_token_id == tokenizer.eos_token_ids[0]
    text = "Question: How many legs does a spider have?\nAnswer: eight"
    assert remote.encode(text) == tokenizer.encode(text)
    assert remote.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = remote.apply_chat_template(messages)
    assert remote.encode(rendered) == tokenizer.encode_chat(messages)


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
])
def test_bad_bodies_get_a_typed_400(server, path, body, field):
    reply = post(server, path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field


def test_the_gateways_tokenising_threads_run_under_sched_idle(server):
    # Issue 31 item 4: the tokenizers pool's threads yield the cores to the ranks' threads,
    # so a request with heavy tokenising (here many messages with special-token text, batched)
    # waits for its own work instead of stalling the streams decoding beside it.
    gateway = server.pid
    assert policy(gateway, gateway) == os.SCHED_OTHER
    pool = [tid for tid in thread_ids(gateway) if policy(tid, gateway) == os.SCHED_IDLE]
    assert pool, "no thread of the gateway runs under SCHED_IDLE"
    before = sum(cpu_ticks(tid, gateway) for tid in pool)
    messages = [{"role": "user", "content": f"<|im_start|> message {i} " + "word " * 200}
                for i in range(400)]
    assert post(server, "/tokenize", {"messages": messages}).status_code == 200
    assert sum(cpu_ticks(tid, gateway) for tid in pool) > before
