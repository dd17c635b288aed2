"""Speculative decoding end to end on dummy:tiny with a real worker process (issue 34): with
prompt-lookup drafts the output is the one plain decoding gives, token for token, greedy and
seeded-sampled, through preemption, stop strings and log-probabilities beside it; and drafts
really are accepted (so none of this passes by drafting nothing)."""

import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

# Copy-heavy: each prompt repeats a short phrase, so its own history predicts a lot.
PROMPTS = [[5 + i, 17, 99, 3 + i, 42, 8] * (3 + i) for i in range(6)]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
# Few candidates a token, so its history predicts it now and then.
SAMPLED = SamplingParams(max_tokens=48, temperature=1.0, top_k=2, seed=5, ignore_eos=True)
PENALISED = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                            frequency_penalty=0.4, presence_penalty=0.2),
             SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.3),
             SamplingParams(max_tokens=48, temperature=1.0, top_k=3, seed=9, ignore_eos=True,
                            frequency_penalty=0.3, repetition_penalty=1.1)] * 2


def tiny(method: str, num_blocks=None, k=4) -> EngineConfig:
    return EngineConfig(model="dummy:tiny", dtype="float32",
                        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                        speculative=SpeculativeConfig(method=method, num_speculative_tokens=k))


@pytest.fixture(autouse=True)
def self_check(monkeypatch):
    """The core checks its block bookkeeping after every step (self_check_failures)."""
    monkeypatch.setenv("TOKSTREAM_SELF_CHECK", "1")


def logprobs_params():
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def plain():
    """Every case decoded without speculation."""
    with LLM(tiny("off")) as llm:
        greedy = llm.generate(PROMPTS, GREEDY)
        text = llm.generate([PROMPTS[2]], GREEDY)[0].text
        return {
            "greedy": [c.token_ids for c in greedy],
            "sampled": [c.token_ids for c in llm.generate(PROMPTS, SAMPLED)],
            "logprobs": llm.generate(PROMPTS[:2], [logprobs_params(), GREEDY]),
            "penalised": [c.token_ids for c in llm.generate(PROMPTS, PENALISED)],
            "text": text,
        }


def assert_sound(llm):
    core = llm.core
    assert core.recovery.self_check_failures == 0
    assert core.scheduler.check() == []
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_greedy_output_equals_plain_decoding_with_drafts_accepted(plain):
    with LLM(tiny("ngram")) as llm:
        out = llm.generate(PROMPTS, GREEDY)
        stats = llm.core.speculator.stats
        assert [c.token_ids for c in out] == plain["greedy"]
        assert stats.num_accepted_tokens > 0, stats
        assert all(c.finish_reason == "length" and len(c.token_ids) == 48 for c in out)
        assert_sound(llm)
        snapshot = llm.core.snapshot()["speculation"]
        assert snapshot["num_accepted_tokens"] == stats.num_accepted_tokens
        assert snapshot["method"] == "ngram"


def test_deltas_carry_several_tokens_with_contiguous_indices(plain):
    with LLM(tiny("ngram")) as llm:
        deltas = list(llm.stream([llm.request(PROMPTS[0], GREEDY)]))
    tokens, indices = [], []
    for delta in deltas:
        tokens += delta.token_ids
        indices += range(delta.first_index, delta.first_index + len(delta.token_ids))
    assert indices == list(range(48)) and tokens == plain["greedy"][0]
    assert max(len(d.token_ids) for d in deltas) > 1
    assert deltas[-1].num_output_tokens == 48


@pytest.mark.parametrize("kind", ["sampled", "penalised"])
def test_sampled_and_penalised_output_equals_plain_decoding(plain, kind):
    """Seeded sampled requests, and penalised ones (greedy and sampled), draft too: a penalised
    row's penalties count the drafts before it as output, as plain decoding counts the tokens
    there."""
    with LLM(tiny("ngram")) as llm:
        out = llm.generate(PROMPTS, SAMPLED if kind == "sampled" else PENALISED)
        stats = llm.core.speculator.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        assert [c.token_ids for c in out] == plain[kind]
        assert_sound(llm)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_tiny_pool_preempts_and_outputs_are_unchanged(plain, kind):
    """Blocks freed by rejected drafts are soon another request's: a worker whose block
    table kept them would read and write the wrong K/V."""
    # 40 blocks of 4 tokens: the six requests need about 100 at their ends.
    with LLM(tiny("ngram", num_blocks=40)) as llm:
        out = llm.generate(PROMPTS, GREEDY if kind == "greedy" else SAMPLED)
        assert llm.core.scheduler.num_preemptions > 0
        assert llm.core.speculator.stats.num_accepted_tokens > 0
        assert [c.token_ids for c in out] == plain[kind]
        assert_sound(llm)


def test_logprobs_with_speculation(plain):
    """A request asking for logprobs gets one per token, drafted or not, equal to plain
    decoding's, in steps where another request verifies drafts too."""
    with LLM(tiny("ngram")) as llm:
        deltas = list(llm.stream([llm.request(PROMPTS[0], logprobs_params())]))
        assert max(len(d.token_ids) for d in deltas) > 1  # it did speculate
        assert all(len(d.logprobs or []) == len(d.token_ids) for d in deltas)
        with_logprobs, speculating = llm.generate(PROMPTS[:2], [logprobs_params(), GREEDY])
    expected, other = plain["logprobs"]
    assert with_logprobs.token_ids == expected.token_ids
    assert speculating.token_ids == other.token_ids
    assert len(with_logprobs.logprobs) == 24
    for got, want in zip(with_logprobs.logprobs, expected.logprobs):
        assert got.top_token_ids == want.top_token_ids
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(plain):
    text = plain["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop])
    with LLM(tiny("off")) as llm:
        (reference,) = llm.generate([PROMPTS[2]], params)
    with LLM(tiny("ngram")) as llm:
        (out,) = llm.generate([PROMPTS[2]], params)
        assert llm.core.speculator.stats.num_accepted_tokens > 0
        assert_sound(llm)
    assert reference.finish_reason == "stop" and reference.stop_reason == stop
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
        reference.token_ids, reference.text, reference.finish_reason, reference.stop_reason)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_resumed_request_drafts_from_its_delivered_tokens(plain, kind):
    """Re-submitted with prompt + delivered tokens (what recovery does), a request drafts from
    that history at once and continues exactly as the uninterrupted plain run."""
    full = plain[kind][4]
    params = GREEDY if kind == "greedy" else SAMPLED
    with LLM(tiny("ngram")) as llm:
        request = EngineRequest("resumed", PROMPTS[4], params, output_token_ids=full[:10])
        deltas = list(llm.stream([request]))
        assert llm.core.speculator.stats.num_draft_tokens > 0
        assert_sound(llm)
    assert deltas[0].first_index == 10
    assert full[:10] + [t for d in deltas for t in d.token_ids] == full
