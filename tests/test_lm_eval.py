"""lm-eval's loglikelihood (multiple-choice) tasks against a real server on SmolLM2 at float32,
compared with transformers on the same items.

local-completions (lm-eval 0.4.13) sends each (context, continuation) pair as one token-id
prompt with `echo: true, logprobs: 1, max_tokens: 1` and reads the continuation's
log-likelihood as sum(token_logprobs[ctxlen:-1]) (the last entry is the sampled token).
test_lm_evals_request_shape sends exactly that with httpx and checks every log-likelihood and
the accuracy it gives against transformers; test_lm_eval_multiple_choice_task runs lm-eval
itself (in the test extra, lm-eval[api]) on a local task, offline."""

import json

import httpx
import pytest
import torch

from helpers.clients import offline
from helpers.serving import module_server
from tokstream.model.source import resolve_model
from tokstream.model.weights import hf_config_dict, load_state_dict
from tokstream.text.tokenizer import load_tokenizer

pytestmark = [pytest.mark.startup, pytest.mark.slow]

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
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    config = LlamaConfig.from_dict(hf_config_dict(source.config))
    config._attn_implementation = "eager"
    with no_init_weights():  # every weight is loaded below (~2 s of random init saved)
        model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(load_state_dict(source, torch.float32),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model


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


def test_lm_eval_multiple_choice_task(server, tokenizer_folder, reference, tmp_path,
                                      monkeypatch):
    offline(monkeypatch)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the json task's dataset cache
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tokstream_mc.yaml").write_text(
        "task: tokstream_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    results = simple_evaluate(
        model="local-completions",
        model_args=(f"model=smollm2,base_url={server.url}/v1/completions,"
                    f"tokenizer={tokenizer_folder},tokenizer_backend=huggingface,"
                    "num_concurrent=1,max_retries=1"),
        tasks=["tokstream_mc"],
        # only the local task: indexing lm-eval's thousands of built-in ones takes ~10 s
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True)
    assert results["results"]["tokstream_mc"]["acc,none"] == pytest.approx(accuracy(reference))
    # and each choice's log-likelihood is transformers'
    samples = sorted(results["samples"]["tokstream_mc"], key=lambda s: s["doc_id"])
    got = [resp[0][0] for sample in samples for resp in sample["resps"]]
    assert got == pytest.approx(reference, abs=2e-3)
