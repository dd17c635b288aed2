"""The real model against Hugging Face transformers on the same dequantised weights, float32.

Greedy token ids must be identical at batch 1 (5 chat prompts, 2 raw prompts, 32 tokens) and
the first-step logits must agree to ~1e-4.
"""

import pytest
import torch

from helpers.hf_reference import hf_greedy, hf_llama
from helpers.prefill import prefill_logits
from tokstream.config import CacheConfig, EngineConfig
from tokstream.engine.llm import LLM
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict
from tokstream.sampling_params import SamplingParams
from tokstream.text.tokenizer import load_tokenizer
from tokstream.worker.model import LlamaModel

pytestmark = [pytest.mark.startup, pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain gravity to a child in one sentence.",
    "List three primary colors.",
]
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def source():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def state_dict(source):
    return load_state_dict(source, torch.float32)


@pytest.fixture(scope="module")
def tokenizer(source):
    return load_tokenizer(source)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chat = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return chat + [tokenizer.encode(p) for p in RAW_PROMPTS]


@pytest.fixture(scope="module")
def hf_model(source, state_dict):
    return hf_llama(source, state_dict)


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompts, source):
    eos = set(source.config.eos_token_ids)
    return [hf_greedy(hf_model, prompt, eos, NEW_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def llm():
    # float32 throughout, the KV cache too: the same arithmetic transformers does
    with LLM(EngineConfig(model="smollm2", dtype="float32", weights="float32",
                          cache=CacheConfig(kv_cache_dtype="float32"))) as engine:
        yield engine


FLOAT16_CACHE_CHANGED = ["List three prime numbers.", "Explain paged attention in one sentence."]
"""Chat prompts whose greedy answer a float16 KV cache changed under an explicit --dtype
float32 (issue 28 item 4)."""


def test_an_explicit_float32_is_float32_throughout(source, tokenizer, prompts, hf_outputs,
                                                  hf_model):
    """--dtype float32 alone, the weights and the cache left to auto: the KV cache is float32
    too, and each prompt alone gives transformers' greedy tokens."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    extra = [tokenizer.encode_chat([{"role": "user", "content": p}])
             for p in FLOAT16_CACHE_CHANGED]
    eos = set(source.config.eos_token_ids)
    expected = hf_outputs + [hf_greedy(hf_model, p, eos, NEW_TOKENS) for p in extra]
    with LLM(EngineConfig(model="smollm2", dtype="float32")) as engine:
        assert engine.core.executor.ready.kv_cache_dtype == "float32"
        for prompt, tokens in zip(prompts + extra, expected):
            (completion,) = engine.generate([prompt], params)
            assert completion.token_ids == tokens


def test_first_step_logits_match(source, state_dict, hf_model, prompts):
    model = LlamaModel(source.config, torch.float32)
    model.load_weights(state_dict)
    for prompt in prompts:
        ours = prefill_logits(model, prompt)
        with torch.inference_mode():
            theirs = hf_model(input_ids=torch.tensor([prompt])).logits[0]
        assert ours.shape == theirs.shape
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


def test_greedy_tokens_match_at_batch_1(llm, prompts, hf_outputs):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    for prompt, expected in zip(prompts, hf_outputs):
        (completion,) = llm.generate([prompt], params)
        assert completion.token_ids == expected


def test_the_reference_answer(llm):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    (completion,) = llm.generate(["What is the capital of France?"], params, chat=True)
    assert len(completion.prompt_token_ids) == 37
    assert completion.text == "The capital of France is Paris."
    assert completion.finish_reason == "stop"


def test_batched_run_matches_batch_1(llm, prompts, hf_outputs):
    """All prompts at once, in one continuously batched run, give the same tokens."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    completions = llm.generate(prompts, params)
    assert [c.token_ids for c in completions] == hf_outputs


def test_logprobs_are_transformers_log_softmax(llm, prompts, hf_model):
    """Each generated token's log-probability and the top 5 alternatives, against
    transformers' log-softmax over the same sequence (teacher-forced), within 1e-3."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    (completion,) = llm.generate([prompts[0]], params)
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    sequence = prompts[0] + completion.token_ids
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([sequence])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, (token, got) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompts[0]) - 1 + i]
        assert abs(got.logprob - float(row[token])) < 1e-3
        top = torch.topk(row, 5)
        assert got.top_token_ids == top.indices.tolist()
        assert max(abs(a - float(b)) for a, b in zip(got.top_logprobs, top.values)) < 1e-3


def test_prompt_logprobs_are_transformers_log_softmax(llm, prompts, hf_model):
    """Each prompt token's log-probability given the tokens before it (SamplingParams.
    prompt_logprobs, from the prefill itself), its rank and the top 5, against transformers'
    log-softmax over the prompt, within 1e-3; the first token has none."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    for prompt in (prompts[0], prompts[-2]):
        (completion,) = llm.generate([prompt], params)
        scored = completion.prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([prompt])).logits[0]
        reference = torch.log_softmax(logits.float(), dim=-1)
        for i in range(1, len(prompt)):
            row, got = reference[i - 1], scored[i]
            assert abs(got.logprob - float(row[prompt[i]])) < 1e-3
            near = int(((row - row[prompt[i]]).abs() < 1e-3).sum())  # ties may order apart
            assert abs(got.rank - (int((row > row[prompt[i]]).sum()) + 1)) < near
            top = torch.topk(row, 5)
            assert got.top_token_ids == top.indices.tolist()
            assert max(abs(a - float(b)) for a, b in zip(got.top_logprobs, top.values)) < 1e-3
