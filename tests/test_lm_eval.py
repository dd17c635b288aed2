"""lm-eval against a real server on SmolLM2 at float32, compared with transformers on the same
items: loglikelihood (multiple-choice) tasks through `local-completions`, and generate_until
tasks through `local-completions` and `local-chat-completions`.

local-completions (lm-eval 0.4.13) sends each (context, continuation) pair as one token-id
prompt with `echo: true, logprobs: 1, max_tokens: 1` and reads the continuation's
log-likelihood as sum(token_logprobs[ctxlen:-1]) (the last entry is the sampled token); with
`batch_size` > 1 it sends that many prompts in one request. Without a `tokenizer` argument it
finds the server's tokenizer routes (GET /tokenizer_info, POST /tokenize, /detokenize) and
tokenises through them. test_lm_evals_request_shape sends exactly that with httpx and checks
every log-likelihood and the accuracy it gives against transformers; the other tests run
lm-eval itself (in the test extra, lm-eval[api]) on local tasks, offline."""

import json
import math

import httpx
import pytest
import torch

from helpers.clients import offline
from helpers.hf_reference import hf_greedy, hf_llama
from helpers.reference_text import TEXT
from helpers.serving import module_server
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict
from tokstream.text.tokenizer import load_tokenizer

pytestmark = [pytest.mark.startup, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

ITEMS = [
    {"question": "What is the capital of France?", "choices": ["London", "Paris", "Berlin"],
     "answer": 1},
    {"question": "How many legs does a spider have?", "choices": ["six", "four", "eight"],
     "answer": 2},
    {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red"],
     "answer": 0},
    {"question": "Which animal says moo?", "choices": ["cat", "cow", "duck"], "answer": 1},
    {"question": "What is 2 + 2?", "choices": ["5", "22", "4"], "answer": 2},
    {"question": "Which planet is known as the red planet?",
     "choices": ["Mars", "Venus", "Saturn"], "answer": 0},
]
"""A small local multiple-choice set; lm-eval asks " " + choice after the context."""


def context(item: dict) -> str:
    return f"Question: {item['question']}\nAnswer:"


server = module_server("--profile", "ci", "--model", "smollm2", "--weights", "float32",
                       "--dtype", "float32", "--num-blocks", "256")


@pytest.fixture(scope="module")
def source():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def tokenizer_folder(source, tmp_path_factory):
    """The served tokenizer as a Hugging Face folder (what lm-eval's `tokenizer=` loads)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(source).save(folder)
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tokenizer_folder))


@pytest.fixture(scope="module")
def hf_model(source):
    return hf_llama(source, load_state_dict(source, torch.float32))


def encode_pair(hf_tokenizer, ctx: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's TemplateLM._encode_pair splits them."""
    spaces = len(ctx) - len(ctx.rstrip())
    if spaces:
        ctx, continuation = ctx[:-spaces], ctx[-spaces:] + continuation
    whole = hf_tokenizer.encode(ctx + continuation, add_special_tokens=False)
    ctx_ids = hf_tokenizer.encode(ctx, add_special_tokens=False)
    return ctx_ids, whole[len(ctx_ids):]


def requests_of(hf_tokenizer) -> list[tuple[int, list[int], list[int]]]:
    """(item index, context ids, continuation ids) for every choice of every item."""
    return [(i, *encode_pair(hf_tokenizer, context(item), " " + choice))
            for i, item in enumerate(ITEMS) for choice in item["choices"]]


def transformers_loglikelihood(hf_model, ctx: list[int], cont: list[int]) -> float:
    ids = ctx + cont
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[j - 1, ids[j]]) for j in range(len(ctx), len(ids)))


def accuracy(loglikelihoods: list[float]) -> float:
    picks, at = [], 0
    for item in ITEMS:
        scores = loglikelihoods[at:at + len(item["choices"])]
        picks.append(max(range(len(scores)), key=scores.__getitem__) == item["answer"])
        at += len(item["choices"])
    return sum(picks) / len(picks)


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer) -> list[float]:
    return [transformers_loglikelihood(hf_model, ctx, cont)
            for _, ctx, cont in requests_of(hf_tokenizer)]


def test_lm_evals_request_shape(server, hf_tokenizer, reference):
    got = []
    for _, ctx, cont in requests_of(hf_tokenizer):
        body = {"model": "smollm2", "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1,
                "logprobs": 1, "seed": 1234, "echo": True}  # LocalCompletionsAPI's payload
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        values = choice["logprobs"]["token_logprobs"]
        assert len(values) == len(ctx) + len(cont) + 1 and values[0] is None
        got.append(sum(values[len(ctx):-1]))
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        assert all(value <= max(top.values()) for value, top in zip(values[len(ctx):-1], tops))
    assert got == pytest.approx(reference, abs=2e-3)
    assert accuracy(got) == accuracy(reference)


def run_lm_eval(tmp_path, monkeypatch, model: str, model_args: str, task: str,
                docs: list[dict] = ITEMS, **kwargs) -> dict:
    """lm-eval's simple_evaluate of one local task (its yaml lines after `task:`) on docs,
    offline."""
    offline(monkeypatch)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the json task's dataset cache
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "tokstream_task.yaml").write_text(
        "task: tokstream_task\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n" + task)
    results = simple_evaluate(
        model=model, model_args=f"model=smollm2,num_concurrent=1,max_retries=1,{model_args}",
        tasks=["tokstream_task"],
        # only the local task: indexing lm-eval's thousands of built-in ones takes ~10 s
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, **kwargs)
    results["samples"] = sorted(results["samples"]["tokstream_task"],
                                key=lambda s: s["doc_id"])
    return results


QUESTION = "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"

MULTIPLE_CHOICE = (QUESTION + "output_type: multiple_choice\n"
                   "doc_to_choice: \"{{choices}}\"\n"
                   "doc_to_target: \"{{answer}}\"\n"
                   "metric_list:\n  - metric: acc\n")


@pytest.mark.parametrize("tokenizer_args", [
    "tokenizer={folder},tokenizer_backend=huggingface",
    "batch_size=4",  # no tokenizer given: lm-eval finds the server's (remote)
])
def test_lm_eval_multiple_choice_task(server, tokenizer_folder, reference, tmp_path,
                                      monkeypatch, tokenizer_args):
    results = run_lm_eval(tmp_path, monkeypatch, "local-completions",
                          f"base_url={server.url}/v1/completions,"
                          + tokenizer_args.format(folder=tokenizer_folder), MULTIPLE_CHOICE)
    assert results["results"]["tokstream_task"]["acc,none"] == \
        pytest.approx(accuracy(reference))
    # and each choice's log-likelihood is transformers'
    got = [resp[0][0] for sample in results["samples"] for resp in sample["resps"]]
    assert got == pytest.approx(reference, abs=2e-3)


GENERATE = (QUESTION + "output_type: generate_until\n"
            "doc_to_target: \" {{choices[answer]}}\"\n"
            "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 24\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n")

GENERATED_TOKENS = 24


def greedy_answers(hf_model, tokenizer, prompts: list[list[int]]) -> list[str]:
    """transformers' greedy text for each prompt, cut at the task's stop ("\n")."""
    eos = set(tokenizer.eos_token_ids)
    return [tokenizer.decode(hf_greedy(hf_model, ids, eos, GENERATED_TOKENS)).split("\n")[0]
            for ids in prompts]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_lm_eval_generate_until_task(server, hf_model, source, tmp_path, monkeypatch, route):
    """Greedy answers stopped at a newline, as transformers writes them: through
    local-completions (a batch of three token-id prompts a request, the server's tokenizer),
    and through local-chat-completions with the chat template applied on the server."""
    tokenizer = load_tokenizer(source)
    contexts = [context(item) for item in ITEMS]
    if route == "completions":
        results = run_lm_eval(tmp_path, monkeypatch, "local-completions",
                              f"base_url={server.url}/v1/completions,batch_size=3", GENERATE)
        prompts = [tokenizer.encode(text) for text in contexts]
    else:
        results = run_lm_eval(tmp_path, monkeypatch, "local-chat-completions",
                              f"base_url={server.url}/v1/chat/completions", GENERATE,
                              apply_chat_template=True)
        prompts = [tokenizer.encode_chat([{"role": "user", "content": text}])
                   for text in contexts]
    answers = greedy_answers(hf_model, tokenizer, prompts)
    got = [sample["resps"][0][0] for sample in results["samples"]]
    assert got == answers
    targets = [" " + item["choices"][item["answer"]] for item in ITEMS]
    assert results["results"]["tokstream_task"]["exact_match,none"] == pytest.approx(
        sum(a == t for a, t in zip(answers, targets)) / len(ITEMS))


ROLLING = ("output_type: loglikelihood_rolling\n"
           "doc_to_text: \"\"\n"
           "doc_to_target: \"{{text}}\"\n"
           "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")


def test_lm_eval_perplexity_task_over_rolling_windows(server, hf_model, source, tmp_path,
                                                      monkeypatch):
    """A loglikelihood_rolling task (what wikitext's perplexity is): with max_length 64 each
    paragraph is scored in several windows, two a request; each paragraph's log-likelihood
    is transformers' over the same windows."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    docs = [{"text": text} for text in TEXT.split("\n\n")[:3]]
    results = run_lm_eval(tmp_path, monkeypatch, "local-completions",
                          f"base_url={server.url}/v1/completions,batch_size=2,max_length=64",
                          ROLLING, docs)
    tokenizer = load_tokenizer(source)
    # lm-eval's prefix for the first window, as its remote tokenizer finds it
    prefix = tokenizer.bos_token_id or tokenizer.eos_token_ids[0]
    expected = []
    for doc in docs:
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            tokenizer.encode(doc["text"]), prefix, max_seq_len=62, context_len=1)]
        assert len(windows) >= 2
        expected.append(sum(transformers_loglikelihood(hf_model, ctx, cont)
                            for ctx, cont in windows))
    got = [sample["resps"][0][0] for sample in results["samples"]]
    assert got == pytest.approx(expected, abs=1e-2)
    words = sum(len(doc["text"].split()) for doc in docs)
    assert results["results"]["tokstream_task"]["word_perplexity,none"] == pytest.approx(
        math.exp(-sum(expected) / words), rel=1e-3)
