"""vLLM's request extensions on the OpenAI routes, on a real server: `stop_token_ids`,
`min_tokens`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `skip_special_tokens`, `include_stop_str_in_output`, `stream_options.continuous_usage_stats` and the older `guided_*`
structured-output fields do what vLLM does, streamed and not; the extensions tokstream does not do
(VLLM_UNSUPPORTED) are a 400 naming the field instead of being silently ignored."""

import json

import httpx
import pytest

from helpers.serving import module_server, record
from tokstream.checker import check_streams
from tokstream.model.presets import dummy_config
from tokstream.model.source import ModelSource, embedded_gguf_path
from tokstream.server.api.sampling_options import VLLM_UNSUPPORTED, bad_words_token_ids
from tokstream.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.startup

MODEL = "dummy:tiny"
BOS = 1
"""dummy:tiny's <|bos|>, a special token."""

# Every prompt computed afresh: dummy:tiny's near-uniform draws can flip between a cached and
# a computed prefix (float rounding), and these tests compare requests token for token.
server = module_server("--profile", "ci", "--no-prefix-caching")


def complete(server, route="/v1/completions", **body) -> dict:
    reply = httpx.post(server.url + route, json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(server, route="/v1/completions", **body) -> tuple[str, dict]:
    """(the text, the last chunk's choice) of a streamed request; its stream passes the
    checker."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        _, stream = record(http, route, {"model": MODEL, "stream": True, **body})
    assert check_streams([stream]).ok
    chunks = [json.loads(e.data) for e in stream.events if e.data.startswith("{")]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for c in choices)
    return text, choices[-1]


def seeded(**body) -> dict:
    """A sampled completion that repeats under its seed (greedy, dummy:tiny repeats one
    token)."""
    return {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 1.0, "seed": 7,
            "ignore_eos": True, **body}


def test_a_stop_token_id_ends_the_output_at_it(server):
    tokens = complete(server, **seeded())["tokstream"]["token_ids"]
    at = next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])
    reply = complete(server, **seeded(stop_token_ids=[tokens[at]]))
    (choice,) = reply["choices"]
    assert reply["tokstream"]["token_ids"] == tokens[:at + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", tokens[at])
    text, last = streamed(server, **seeded(stop_token_ids=[tokens[at]]))
    assert text == choice["text"] and last["stop_reason"] == tokens[at]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_the_stop_string_is_kept_when_asked(server, route):
    body = seeded() if route == "/v1/completions" else dict(
        messages=[{"role": "user", "content": "the quick brown fox"}], max_tokens=12,
        temperature=1.0, seed=7, ignore_eos=True)
    whole = complete(server, route, **body)["choices"][0]
    whole = whole.get("text", (whole.get("message") or {}).get("content"))
    stop = whole[4:6]
    cut = whole[:whole.index(stop)]
    assert cut and stop.strip()
    for include, want in ((False, cut), (True, cut + stop)):
        extra = {"stop": [stop], "include_stop_str_in_output": include}
        choice = complete(server, route, **body, **extra)["choices"][0]
        assert choice.get("text", (choice.get("message") or {}).get("content")) == want
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        assert streamed(server, route, **body, **extra)[0] == want


EOS = 2
"""dummy:tiny's end-of-sequence id."""


def test_min_tokens_holds_the_end_back(server):
    # The end, made likeliest by a bias, ends the output at once; with min_tokens 5 it comes
    # sixth (the sampler bans it before), through the stop-id path too.
    body = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}
    alone = complete(server, **body, logit_bias={str(EOS): 100})
    assert alone["usage"]["completion_tokens"] == 1
    held = complete(server, **body, logit_bias={str(EOS): 100}, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 6
    assert held["choices"][0]["finish_reason"] == "stop"
    assert EOS not in held["tokstream"]["token_ids"][:5]
    stop_id = 100
    ids = complete(server, **body, logit_bias={str(stop_id): 100}, stop_token_ids=[stop_id],
                   min_tokens=3)
    assert stop_id not in ids["tokstream"]["token_ids"][:3]
    assert ids["tokstream"]["token_ids"][3:] == [stop_id]
    assert ids["choices"][0]["stop_reason"] == stop_id
    # Stop strings are looked for only in the text after the first min_tokens tokens
    # (greedy: dummy:tiny repeats one token, whose text is the stop string).
    body = {**body, "ignore_eos": True}
    word = complete(server, **{**body, "max_tokens": 1})["choices"][0]["text"]
    cut = complete(server, **body, stop=[word])["choices"][0]
    assert cut["text"] == "" and cut["stop_reason"] == word
    for route_streamed in (False, True):
        extra = {**body, "stop": [word], "min_tokens": 3}
        later = (streamed(server, **extra)[0] if route_streamed
                 else complete(server, **extra)["choices"][0]["text"])
        assert later == word * 3


def test_only_allowed_token_ids_are_sampled(server):
    for temperature in (0, 1.0):
        reply = complete(server, **seeded(temperature=temperature,
                                          allowed_token_ids=[100, 101, 102]))
        assert set(reply["tokstream"]["token_ids"]) <= {100, 101, 102}
        assert len(reply["tokstream"]["token_ids"]) == 12


def test_bad_words_never_appear(server):
    # dummy:tiny's greedy output repeats one word: banned, the output is other words.
    body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    word = complete(server, **{**body, "max_tokens": 1})["choices"][0]["text"]
    text = complete(server, **body, bad_words=[word.strip()])["choices"][0]["text"]
    assert word.strip() not in text.split() and len(text.split()) >= 4
    assert streamed(server, **body, bad_words=[word.strip()])[0] == text


def test_a_bad_word_is_banned_as_it_starts_the_text_and_after_a_space():
    tok = load_tokenizer(ModelSource("gguf", embedded_gguf_path(),
                                     dummy_config("smollm2-135m")))
    assert tok.encode_text("Paris") != tok.encode_text(" Paris")  # SmolLM2 marks the space
    assert bad_words_token_ids({"bad_words": ["Paris", " Paris", "Eiffel Tower"]}, tok) == [
        tok.encode_text("Paris"), tok.encode_text(" Paris"), tok.encode_text("Eiffel Tower"),
        tok.encode_text(" Eiffel Tower")]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_truncated_prompt_is_its_last_tokens(server, route):
    sampling = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if route == "/v1/completions":
        given = {"prompt": [(7 + 13 * i) % 500 for i in range(30)]}
        ids = given["prompt"]
    else:
        given = {"messages": [{"role": "user", "content": "a long question " * 4}]}
        ids = httpx.post(server.url + "/tokenize", json=given, timeout=60).json()["tokens"]
    cut = complete(server, route, **given, **sampling, truncate_prompt_tokens=5)
    assert cut["usage"]["prompt_tokens"] == 5
    tail = complete(server, "/v1/completions", prompt=ids[-5:], **sampling)
    assert cut["tokstream"]["token_ids"] == tail["tokstream"]["token_ids"]
    # -1: as much of it as the context holds beside max_tokens (2048 in the ci profile)
    long = ({"prompt": "x" * 3000} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": "x" * 3000}]})
    whole = complete(server, route, **long, **{**sampling, "max_tokens": 8},
                     truncate_prompt_tokens=-1)
    assert whole["usage"]["prompt_tokens"] == 2048 - 8


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_count_every_chunk(server, route):
    body = (seeded() if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 1.0,
        "seed": 7, "ignore_eos": True})
    def chunks_of(**options) -> list[dict]:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            _, stream = record(http, route, {"model": MODEL, "stream": True, **body,
                                             "stream_options": options})
        return [json.loads(e.data) for e in stream.events if e.data.startswith("{")]

    chunks = chunks_of(include_usage=True, continuous_usage_stats=True)
    counted, seen = [], 0
    for chunk in chunks[:-1]:
        seen += len((chunk.get("tokstream") or {}).get("token_ids") or ())
        counted.append(chunk["usage"]["completion_tokens"])
        assert chunk["usage"]["completion_tokens"] == seen
        assert chunk["usage"]["total_tokens"] == chunk["usage"]["prompt_tokens"] + seen
    assert counted[-1] == 12 and counted == sorted(counted)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    plain = chunks_of(include_usage=True)  # usage on the last chunk only, as before
    assert all(chunk["usage"] is None for chunk in plain[:-1])
    assert plain[-1]["usage"] == chunks[-1]["usage"]


def test_special_tokens_show_when_not_skipped(server):
    body = seeded(logit_bias={str(BOS): 100}, max_tokens=3)
    assert complete(server, **body)["choices"][0]["text"] == ""
    shown = complete(server, **body, skip_special_tokens=False)["choices"][0]["text"]
    assert shown == "<|bos|>" * 3
    assert streamed(server, **body, skip_special_tokens=False)[0] == shown


@pytest.mark.parametrize("guided, new", [
    ({"guided_choice": ["alpha", "beta", "gamma"]}, {"choice": ["alpha", "beta", "gamma"]}),
    ({"guided_regex": "[a-c]{4}"}, {"regex": "[a-c]{4}"}),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"], "additionalProperties": False}},
     {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
               "required": ["a"], "additionalProperties": False}}),
])
def test_guided_fields_are_structured_outputs(server, guided, new):
    body = dict(messages=[{"role": "user", "content": "pick"}], max_tokens=24,
                temperature=1.0, seed=3)
    old = complete(server, "/v1/chat/completions", **body, **guided)
    now = complete(server, "/v1/chat/completions", **body, structured_outputs=new)
    assert old["tokstream"]["token_ids"] == now["tokstream"]["token_ids"]
    free = complete(server, "/v1/chat/completions", **body)
    assert free["tokstream"]["token_ids"] != now["tokstream"]["token_ids"]


@pytest.mark.parametrize("extra, field", [
    *[({name: value}, name) for name, value in {
        "use_beam_search": True, "length_penalty": 0.5, "return_tokens_as_token_ids": True, "prompt_embeds": "AAAA",
        "mm_processor_kwargs": {"a": 1}, "documents": [{"text": "x"}],
        "structural_tag": "{}", "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
        "priority": 2, "typical_p": 0.5, "top_a": 0.2}.items()],
    ({"stop_token_ids": [10 ** 6]}, "stop_token_ids.0"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"guided_choice": "alpha"}, "guided_choice"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1, "guided_regex": "a+"}, "min_tokens"),
    ({"allowed_token_ids": [5], "guided_regex": "a+"}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids.0"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"bad_words": "x"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words.0"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
])
def test_what_tokstream_does_not_do_is_a_400_naming_it(server, extra, field):
    reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


def test_every_unsupported_extension_is_tested():
    assert set(VLLM_UNSUPPORTED) == {
        "use_beam_search", "length_penalty", "return_tokens_as_token_ids",
        "prompt_embeds",
        "mm_processor_kwargs", "documents", "structural_tag", "kv_transfer_params",
        "vllm_xargs", "priority", "typical_p", "top_a"}
