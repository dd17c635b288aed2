"""Several prompts in one `/v1/completions` request (OpenAI's and vLLM's batch; lm-eval's
`local-completions` sends one per `batch_size`), on a real server: prompt p's n choices are
indices p*n to p*n + n - 1, each exactly what that prompt alone gives under the same seed,
streamed and not, echoed with its own prompt; usage sums the prompts; a typed 400 names the
prompt at fault; a batch larger than the queue's request bound is still admitted into an empty
queue, and behind others it waits its turn (a pure-Python admission test)."""

import httpx
import openai
import pytest

from helpers.serving import ServerProcess, record
from tokstream.checker import MAX_RESPONSE_CHOICES, check_streams
from tokstream.gateway_config import AdmissionConfig
from tokstream.server.access.gateway_admission import Admission
from tokstream.server.api_errors import ApiError

pytestmark = pytest.mark.startup

MODEL = "dummy:tiny"
MAIN, ADMIN = "sk-main-batch", "sk-admin-batch"


def prompt_ids(tag: int, length: int = 30) -> list[int]:
    """A prompt no other test sends (so its prefix-cache hits are this test's own)."""
    return [(11 + tag * 37 + i * 17) % 500 for i in range(length)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tokstream.server.access.tenants import hash_key

    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(f'admin_key_sha256 = "{hash_key(ADMIN)}"\n'
                       f'[[tenant]]\nname = "main"\nkey_sha256 = "{hash_key(MAIN)}"\n')
    # A request bound of 2, below the batches sent here.
    with ServerProcess("--profile", "ci", "--tenants", str(tenants),
                       "--max-waiting-requests", "2") as server:
        yield server


def complete(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body},
                      headers={"authorization": f"Bearer {MAIN}"}, timeout=120)


def test_each_prompts_choices_equal_that_prompt_alone(server):
    prompts = [prompt_ids(1), "a prompt as text", prompt_ids(2, length=12)]
    body = dict(max_tokens=5, temperature=1.0, seed=23, ignore_eos=True)
    reply = complete(server, prompt=prompts, n=2, **body)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    assert [c["index"] for c in reply["choices"]] == list(range(6))
    lone = [complete(server, prompt=p, n=2, **body).json() for p in prompts]
    records = reply["tokstream"]["choices"]
    for p, alone in enumerate(lone):
        for j in range(2):
            assert reply["choices"][2 * p + j]["text"] == alone["choices"][j]["text"]
            assert records[2 * p + j]["token_ids"] == \
                alone["tokstream"]["choices"][j]["token_ids"]
    assert len({tuple(r["token_ids"]) for r in records}) == 6  # seeds 23, 24 and prompts differ
    # Each prompt counted once; every choice's output counted.
    prompt_tokens = sum(alone["usage"]["prompt_tokens"] for alone in lone)
    assert prompt_tokens == 30 + len("a prompt as text") + 12  # dummy:tiny: a token a byte
    assert reply["usage"]["prompt_tokens"] == prompt_tokens
    assert reply["usage"]["completion_tokens"] == 30
    assert reply["usage"]["total_tokens"] == prompt_tokens + 30
    # Within a prompt the other choice takes the first one's blocks; across prompts nothing.
    # (full blocks of 4, less the one token always computed).
    assert [r["cached_tokens"] for r in records] == [0, 28, 0, 12, 0, 8]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # One request for the tenant, settled once every choice ended.
    state = server.wait_idle(authorization=f"Bearer {ADMIN}")
    (row,) = [t for t in state["tenants"] if t["name"] == "main"]
    assert row["live"] == 0


def test_a_batch_streams_each_choice_intact_through_the_sdk_and_the_checker(server):
    prompts = ["first prompt", "second, longer prompt", "third"]
    body = dict(model=MODEL, prompt=prompts, max_tokens=6, temperature=0.8, seed=5,
                extra_body={"ignore_eos": True})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=MAIN, max_retries=0)
    whole = client.completions.create(**body)
    streamed, finished, usage = [""] * 3, [None] * 3, None
    for chunk in client.completions.create(**body, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
        finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert streamed == [c.text for c in whole.choices]
    assert finished == ["length"] * 3
    assert (usage.prompt_tokens, usage.completion_tokens) == \
        (whole.usage.prompt_tokens, 18) == (sum(map(len, prompts)), 18)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _, recorded = record(http, "/v1/completions", {
            "model": MODEL, "prompt": prompts, "max_tokens": 6, "temperature": 0.8, "seed": 5,
            "ignore_eos": True, "stream": True}, {"authorization": f"Bearer {MAIN}"})
    recorded.num_choices = 3
    report = check_streams([recorded])
    assert report.ok and report.statuses["complete"] == 3, report.summary()
    assert [s.token_ids for s in report.streams] == \
        [c["token_ids"] for c in whole.model_extra["tokstream"]["choices"]]


def test_lm_evals_batched_loglikelihood_request_echoes_each_prompt(server):
    """LocalCompletionsAPI with batch_size > 1: token-id prompts, echo, logprobs 1,
    max_tokens 1; each choice scores its own prompt as a lone request does."""
    prompts = [prompt_ids(3, length=8), prompt_ids(4, length=13)]
    body = dict(temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
    batched = complete(server, prompt=prompts, **body).json()["choices"]
    for prompt, choice in zip(prompts, batched):
        (alone,) = complete(server, prompt=[prompt], **body).json()["choices"]
        assert choice["text"] == alone["text"]
        got, want = choice["logprobs"], alone["logprobs"]
        assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"])
        # Computed in another batch of rows: equal but for float rounding.
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-4)
        assert len(got["token_logprobs"]) == len(prompt) + 1
    streamed = complete(server, prompt=["ab", "cde"], max_tokens=2, echo=True, temperature=0,
                        stream=True)
    texts = ["", ""]
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
            texts[choice["index"]] += choice["text"]
    assert texts[0].startswith("ab") and texts[1].startswith("cde")


@pytest.mark.parametrize("prompt, n, field, words", [
    ([], 1, "prompt", "non-empty array"),
    (["a", []], 1, "prompt.1", "non-empty array of token ids"),
    (["a", [1, 99999]], 1, "prompt.1", "outside the vocabulary"),
    (["a", {"text": "b"}], 1, "prompt.1", "must be a string"),
    (["a", [1, True]], 1, "prompt.1", "must be a string"),
    (["a", ""], 1, "prompt.1", "empty"),
    (["a", "x" * 3000], 1, "prompt.1", "context"),
    (["a"] * (MAX_RESPONSE_CHOICES + 1), 1, "prompt", f"at most {MAX_RESPONSE_CHOICES}"),
    (["a"] * 17, 16, "prompt", "choices"),
])
def test_a_bad_prompt_in_a_batch_is_a_400_naming_it(server, prompt, n, field, words):
    response = complete(server, prompt=prompt, n=n, max_tokens=2)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert words in error["message"], error


def test_max_tokens_past_one_prompts_room_is_a_400(server):
    response = complete(server, prompt=["a", "b" * 2000], max_tokens=100)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_a_batch_larger_than_the_request_bound_enters_an_empty_queue():
    admission = Admission(AdmissionConfig(max_waiting_requests=2, max_waiting_tokens=1000))
    admission.check(40, num_requests=5)  # nothing waits: admitted, or it never would be
    admission.enter(10)
    admission.check(10, num_requests=1)
    with pytest.raises(ApiError) as refused:
        admission.check(20, num_requests=2)  # 1 waiting + 2 would pass 2
    assert refused.value.error_type == "overloaded_error"
    admission = Admission(AdmissionConfig(max_waiting_requests=2, max_waiting_tokens=1000))
    admission.set_weights({"a": 1.0, "b": 1.0})  # a share of 1 request each
    admission.check(10, "a", num_requests=3)
    admission.enter(10, "a")
    with pytest.raises(ApiError) as limited:
        admission.check(10, "a", num_requests=1)
    assert limited.value.error_type == "rate_limit_error"


def test_a_batch_past_the_servers_request_bound_is_served(server):
    reply = complete(server, prompt=["one", "two", "three", "four", "five"], max_tokens=2,
                     temperature=0)
    assert reply.status_code == 200, reply.text
    assert [c["finish_reason"] for c in reply.json()["choices"]] == ["length"] * 5
