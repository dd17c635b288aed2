"""Prompt logprobs (SamplingParams.prompt_logprobs) computed in the prompt's own prefill: every
prompt token scored once (the first None), each chunk of a chunked prefill contributing its
positions, no prefix-cache hit skipping positions, a preemption losing or repeating none. The
scheduler cases run without a model; the engine cases on dummy:tiny (transformers parity on
SmolLM2 is in test_parity.py)."""

import pytest

from test_scheduler import make_request, make_scheduler, run_step
from tokstream.config import EngineConfig, SchedulerConfig
from tokstream.engine.llm import LLM
from tokstream.engine.messages.worker import StepPlan
from tokstream.sampling_params import SamplingParams

PROMPT = [(7 * i) % 400 + 3 for i in range(45)]
"""45 tokens: two full 16-token blocks the prefix cache can hold, and a part block."""


def scored_positions(plans: list[StepPlan], request_id: str, num_prompt: int) -> dict:
    """prompt index -> target token, as a worker reads the plans (model_runner.prompt_rows):
    position p of a scoring request's chunk predicts prompt token p + 1."""
    scoring, targets = False, {}
    for plan in plans:
        for new in plan.new_requests:
            if new.request_id == request_id:
                scoring = new.prompt_logprobs is not None
        for chunk in plan.chunks:
            if chunk.request_id != request_id or not scoring:
                continue
            following = chunk.token_ids[1:] + [chunk.next_prompt_token]
            for offset in range(len(chunk.token_ids)):
                if chunk.start_position + offset < num_prompt - 1:
                    targets.setdefault(chunk.start_position + offset + 1, []).append(
                        following[offset])
    return targets


def test_a_prompt_scoring_request_takes_no_prefix_cache_hit():
    s = make_scheduler(num_blocks=32, block_size=4)
    first = make_request("first", prompt_len=12, max_tokens=2, prompt=list(range(100, 112)))
    s.add_request(first)
    while s.has_work:
        run_step(s)
    again = make_request("again", max_tokens=2, prompt=list(range(100, 112)), prompt_logprobs=1)
    s.add_request(again)
    plans = []
    while s.has_work:
        out = s.schedule()
        plans.append(out.plan(len(plans)))
        s.update(out, [7 for w in out.work if w.samples])
    assert s.block_manager.prefix_hits == 0, "a cached prefix was skipped, never scored"
    targets = scored_positions(plans, "again", 12)
    assert targets == {i: [100 + i] for i in range(1, 12)}
    plain = make_request("plain", max_tokens=2, prompt=list(range(100, 112)))
    s.add_request(plain)
    run_step(s)
    assert s.block_manager.prefix_hits > 0  # the cache was there to take


def test_chunks_and_a_preemption_score_every_prompt_token():
    s = make_scheduler(num_blocks=7, block_size=4, budget=5)
    a = make_request("a", prompt_len=4, max_tokens=20)
    b = make_request("b", prompt_len=14, max_tokens=3, prompt_logprobs=2)
    s.add_request(a)
    plans = []
    for step in range(200):
        if step == 11:  # a holds 4 of the 7 blocks and needs more as b is prefilled
            s.add_request(b)
        if not s.has_work:
            break
        out = s.schedule()
        if b in out.preempted:
            assert not b.output_token_ids  # preempted while its prompt was being scored
        plans.append(out.plan(len(plans)))
        s.update(out, [7 for w in out.work if w.samples])
        assert s.check() == []
    assert b.num_preemptions >= 1 and b.output_token_ids == [7] * 3
    targets = scored_positions(plans, "b", 14)
    assert sorted(targets) == list(range(1, 14))
    assert all(set(t) == {b.prompt_token_ids[i]} for i, t in targets.items())
    # once it has output, a re-admission no longer asks the worker to score the prompt
    b.output_token_ids.append(7)
    assert not b.scores_prompt


@pytest.fixture(scope="module")
def whole():
    with LLM(EngineConfig(model="dummy:tiny", dtype="float32")) as llm:
        yield llm


@pytest.fixture(scope="module")
def chunked():
    config = EngineConfig(model="dummy:tiny", dtype="float32",
                          scheduler=SchedulerConfig(max_num_batched_tokens=16))
    with LLM(config) as llm:
        yield llm


def prompt_logprobs(llm, prompt=PROMPT, num_top=3):
    (completion,) = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0,
                                                          prompt_logprobs=num_top))
    return completion


@pytest.mark.startup
def test_each_prompt_token_is_scored_once(whole):
    completion = prompt_logprobs(whole)
    scored = completion.prompt_logprobs
    assert len(scored) == len(PROMPT) and scored[0] is None
    for token, lp in zip(PROMPT[1:], scored[1:]):
        assert lp.logprob <= 0 and lp.rank >= 1 and len(lp.top_token_ids) == 3
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert (lp.rank == 1) == (lp.top_token_ids[0] == token)
        assert lp.logprob <= lp.top_logprobs[0]
    # without prompt_logprobs, none come back
    (plain,) = whole.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))
    assert plain.prompt_logprobs is None


@pytest.mark.startup
def test_cached_prefix_blocks_are_computed_for_prompt_logprobs(whole):
    other = [5] + PROMPT[1:]
    fresh = prompt_logprobs(whole, other)
    (cached,) = whole.generate([other], SamplingParams(max_tokens=2, temperature=0))
    assert cached.num_cached_tokens == 32  # the cache now holds the prompt's two full blocks
    again = prompt_logprobs(whole, other)
    assert again.num_cached_tokens == 0
    assert [lp and lp.logprob for lp in again.prompt_logprobs] == \
        pytest.approx([lp and lp.logprob for lp in fresh.prompt_logprobs], abs=1e-5)


@pytest.mark.startup
def test_chunked_prefill_gives_the_same_prompt_logprobs(whole, chunked):
    reference = prompt_logprobs(whole, PROMPT[::-1]).prompt_logprobs
    got = prompt_logprobs(chunked, PROMPT[::-1]).prompt_logprobs  # 16 tokens a step
    assert got[0] is None and len(got) == len(reference)
    for a, b in zip(got[1:], reference[1:]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.top_token_ids == b.top_token_ids and a.rank == b.rank
