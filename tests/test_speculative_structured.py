"""Structured outputs with speculative decoding (issue 34 item 2), dummy:tiny with a real
worker: the grammar's matcher follows each drafted row and rolls back to what the request
kept (worker/grammar.py), so a constrained request's output with prompt-lookup drafts is the
one plain decoding gives, token for token, greedy and seeded-sampled, batched and through
preemption; and drafts are really made and accepted, so none of it passes by drafting
nothing. (A refused draft's rows are covered with the real matcher in test_grammar_drafts.)"""

import json
import re

import jsonschema
import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokstream.engine.llm import LLM
from tokstream.sampling_params import SamplingParams
from tokstream.structured import StructuredOutput

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

# A grammar whose output repeats itself (so its own history predicts it) with a choice at
# every word (so some drafts are wrong and the matcher must roll back).
REPEATING = 'start: WORD (" " WORD)*\nWORD: "abc" | "abd" | "xyz"'
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 12}},
    "required": ["items"], "additionalProperties": False}
# The prompts hold the grammar's words followed by characters it refuses ("abc!"), so the
# lookup drafts tokens the matcher must refuse without losing its state.
PROMPTS = ["abc! abd! xyz! abc! " * 4, '{"items": ["red", "red", "blue", "red"]} ' * 3,
           "abc abd abc abd abc abd " * 3, "1-22-333 " * 5]


def params(seed: int | None, kind: str, spec: str, max_tokens=40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0,
                          top_k=-1 if seed is None else 3, seed=seed,
                          structured=StructuredOutput(kind, spec))


CASES = [params(None, "grammar", REPEATING), params(None, "json_schema", json.dumps(SCHEMA)),
         params(3, "grammar", REPEATING), params(7, "json_schema", json.dumps(SCHEMA)),
         params(None, "regex", r"([0-9]-)+[0-9]"), params(11, "grammar", REPEATING)]


def tiny(method: str, num_blocks=None) -> EngineConfig:
    return EngineConfig(model="dummy:tiny", dtype="float32",
                        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                        speculative=SpeculativeConfig(method=method, num_speculative_tokens=4))


@pytest.fixture(autouse=True)
def self_check(monkeypatch):
    monkeypatch.setenv("TOKSTREAM_SELF_CHECK", "1")


def prompts():
    return [PROMPTS[i % len(PROMPTS)] for i in range(len(CASES))]


@pytest.fixture(scope="module")
def plain():
    with LLM(tiny("off")) as llm:
        return [c.token_ids for c in llm.generate(prompts(), CASES)]


def assert_valid(completion, case: SamplingParams):
    spec = case.structured
    if completion.finish_reason != "stop":
        return  # cut at max_tokens: a prefix of a valid output, equal to plain decoding's
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(completion.text), json.loads(spec.spec))
    elif spec.kind == "regex":
        assert re.fullmatch(spec.spec, completion.text)
    else:
        assert re.fullmatch(r"(abc|abd|xyz)( (abc|abd|xyz))*", completion.text)


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_constrained_output_equals_plain_decoding(plain, method):
    with LLM(tiny(method)) as llm:
        out = llm.generate(prompts(), CASES)
        stats = llm.core.speculator.stats
        assert [c.token_ids for c in out] == plain
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        for completion, case in zip(out, CASES):
            assert_valid(completion, case)
        assert llm.core.recovery.self_check_failures == 0


def test_every_kind_of_grammar_drafts_alone_and_keeps_its_output(plain):
    """One request at a time, so the drafts counted are its own: a Lark grammar, a JSON schema
    and a regex each get drafts accepted (a short answer may end before it drafts)."""
    accepted: dict[str, int] = {}
    with LLM(tiny("ngram")) as llm:
        for prompt, case, expected in zip(prompts(), CASES, plain):
            before = llm.core.speculator.stats.num_accepted_tokens
            completion = llm.generate([prompt], case)[0]
            assert completion.token_ids == expected
            assert_valid(completion, case)
            kind = case.structured.kind
            accepted[kind] = (accepted.get(kind, 0)
                              + llm.core.speculator.stats.num_accepted_tokens - before)
    assert all(accepted[kind] > 0 for kind in ("grammar", "json_schema", "regex")), accepted


def test_a_tiny_pool_preempts_constrained_drafting_requests(plain):
    # The first two prompts (80 + 123 tokens) take 51 of the 52 blocks of 4, and both are
    # admitted at the first step: either one's growth preempts, however long their grammars
    # compile. (At 36 blocks preemption needed two later requests to overlap, and a slow
    # compile holding one back let the other finish first: no preemption, once in a suite.)
    with LLM(tiny("ngram", num_blocks=52)) as llm:
        out = llm.generate(prompts(), CASES)
        assert llm.core.scheduler.num_preemptions > 0
        assert [c.token_ids for c in out] == plain
        assert llm.core.speculator.stats.num_accepted_tokens > 0
