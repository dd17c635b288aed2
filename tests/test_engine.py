"""The engine end to end on dummy:tiny with real worker processes: batching, preemption,
seeded sampling, stop handling, the async API and bad input."""

import asyncio

import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig
from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.errors import PromptTooLongError, UserInputError
from tokstream.model.source import resolve_model
from tokstream.sampling_params import SamplingParams
from tokstream.worker.dtype_choice import resolve_kv_cache_dtype

pytestmark = pytest.mark.startup  # starts servers or engines (make test-fast leaves it out)

PROMPTS = [[5 + i, 17, 99, 3 + i] * (i + 1) for i in range(8)]


def tiny(num_blocks=None, max_num_seqs=64, budget=1024, block_size=4):
    return EngineConfig(model="dummy:tiny", dtype="float32",
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=budget))


@pytest.fixture(scope="module")
def reference():
    """Every prompt run alone, greedy and seeded-sampled."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    with LLM(tiny()) as llm:
        return {
            "greedy": [llm.generate([p], greedy)[0].token_ids for p in PROMPTS],
            "sampled": [llm.generate([p], sampled)[0].token_ids for p in PROMPTS],
        }


def test_batched_equals_one_at_a_time(reference):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(tiny(budget=16)) as llm:  # a small budget forces chunked prefill too
        out = llm.generate(PROMPTS, greedy)
    assert [c.token_ids for c in out] == reference["greedy"]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in out)


def test_tiny_pool_preempts_and_outputs_are_unchanged(reference):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    # 24 blocks of 4 tokens: the longest request alone needs 14; all eight need ~90.
    with LLM(tiny(num_blocks=24)) as llm:
        greedy_out = llm.generate(PROMPTS, greedy)
        preemptions = llm.core.scheduler.num_preemptions
        sampled_out = llm.generate(PROMPTS, sampled)
        assert llm.core.block_manager.num_free_blocks == 24
    assert preemptions > 0
    assert llm.core.scheduler.num_preemptions > preemptions
    assert [c.token_ids for c in greedy_out] == reference["greedy"]
    assert [c.token_ids for c in sampled_out] == reference["sampled"]


def test_resume_from_delivered_tokens_continues_identically(reference):
    """Re-submitting prompt + already-delivered tokens continues at the next index, with the
    same seeded choices as the uninterrupted run (what recovery relies on)."""
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    full = reference["sampled"][3]
    with LLM(tiny()) as llm:
        request = EngineRequest("resumed", PROMPTS[3], sampled, output_token_ids=full[:10])
        deltas = list(llm.stream([request]))
    assert deltas[0].first_index == 10
    assert full[:10] + [t for d in deltas for t in d.token_ids] == full


def test_different_seeds_differ_and_unseeded_requests_get_a_seed():
    with LLM(tiny()) as llm:
        a, b = (llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0,
                                                          seed=s, ignore_eos=True))[0]
                for s in (1, 2))
        c = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0,
                                                      ignore_eos=True))[0]
    assert a.token_ids != b.token_ids
    assert len(c.token_ids) == 16


def test_stop_token_and_max_tokens():
    with LLM(tiny()) as llm:
        (free,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0,
                                                             ignore_eos=True))
        stop_at = free.token_ids[5]
        (stopped,) = llm.generate([PROMPTS[1]], SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]))
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_bad_input_is_refused_and_harms_nothing():
    with LLM(tiny()) as llm:
        with pytest.raises(PromptTooLongError):
            llm.core.add_request(EngineRequest("long", [5] * 2048, SamplingParams()))
        with pytest.raises(UserInputError):
            llm.core.add_request(EngineRequest("empty", [], SamplingParams()))
        with pytest.raises(UserInputError):
            llm.core.add_request(EngineRequest("oov", [10**6], SamplingParams()))
        (ok,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0))
        assert len(ok.token_ids) >= 1
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                dict(top_k=-2), dict(temperature=2.5), dict(stop=[""])):
        with pytest.raises(UserInputError):
            SamplingParams(**bad)


def test_unknown_model_is_a_clean_error():
    with pytest.raises(UserInputError):
        LLM(EngineConfig(model="dummy:nope"))


def test_async_engine_streams_aborts_and_rejects(reference):
    async def main():
        engine = await AsyncEngine(tiny()).start()
        try:
            greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

            async def collect(i):
                tokens, indices = [], []
                async for delta in engine.generate(EngineRequest(f"r{i}", PROMPTS[i], greedy)):
                    tokens += delta.token_ids
                    indices += range(delta.first_index, delta.first_index + len(delta.token_ids))
                    last = delta
                assert indices == list(range(len(tokens)))
                assert last.finish_reason == "length" and last.num_output_tokens == 24
                return tokens

            results = await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))
            assert results == reference["greedy"]

            # A caller that stops listening aborts its request in the engine.
            stream = engine.generate(EngineRequest("walkaway", PROMPTS[0], SamplingParams(
                max_tokens=500, temperature=0, ignore_eos=True)))
            await stream.__anext__()
            await stream.aclose()

            # Bad input comes back as one error delta; other requests are unharmed.
            bad = [d async for d in engine.generate(EngineRequest("bad", [5] * 4096, greedy))]
            assert len(bad) == 1 and bad[0].finish_reason == "error" and "context" in bad[0].error
            again = await collect(2)
            assert again == reference["greedy"][2]
        finally:
            await engine.shutdown()
        assert not engine.process.is_alive()

    asyncio.run(main())


def test_prefix_cache_changes_nothing_but_the_work_done():
    """Requests sharing a long system prefix give identical tokens with the cache on or off,
    and with it on most of their prompt is never recomputed."""
    system = [11 + (i * 7) % 400 for i in range(64)]
    prompts = [system + [20 + i, 30 + i, 40 + i] for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    results = {}
    for caching in (False, True):
        config = tiny()
        config.cache.enable_prefix_caching = caching
        with LLM(config) as llm:
            first = llm.generate(prompts[:1], greedy)  # warms the cache with the prefix
            rest = llm.generate(prompts[1:], greedy) + llm.generate(prompts, sampled)
            results[caching] = [c.token_ids for c in first + rest]
            hits = llm.core.block_manager.prefix_hits
        assert (hits > 0) == caching
    assert results[True] == results[False]
    assert hits >= 5 * 64  # every later request found the whole 64-token prefix


@pytest.mark.parametrize("swap_blocks", [64, 3])
def test_swap_preemption_leaves_outputs_unchanged(reference, swap_blocks):
    """The tiny pool again, in swap mode: a preempted request's blocks are copied to host memory
    and back, and it continues without recomputing. With host room for only 3 blocks most
    preemptions fall back to recompute. Either way every token is what the prompt gives alone."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    config = tiny(num_blocks=24)
    # a block's bytes in the cache dtype the worker will choose (float32: the dtype is given)
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, "float32", "cpu",
                                      explicit_dtype=config.dtype != "auto")
    block_bytes = 4 * resolve_model("dummy:tiny").config.kv_bytes_per_token(kv_dtype)
    config.cache.preemption_mode = "swap"
    config.cache.swap_space = swap_blocks * block_bytes
    with LLM(config) as llm:
        assert llm.core.swap_space.num_blocks == swap_blocks
        greedy_out = llm.generate(PROMPTS, greedy)
        sampled_out = llm.generate(PROMPTS, sampled)
        scheduler = llm.core.scheduler
        snapshot = llm.core.snapshot()
        assert llm.core.block_manager.num_free_blocks == 24
        assert llm.core.swap_space.num_free_blocks == swap_blocks
    assert [c.token_ids for c in greedy_out] == reference["greedy"]
    assert [c.token_ids for c in sampled_out] == reference["sampled"]
    assert snapshot["preemption_mode"] == "swap"
    assert snapshot["num_swap_preemptions"] == scheduler.num_swap_outs
    if swap_blocks == 64:
        assert scheduler.num_swap_outs > 0
    else:
        assert scheduler.num_preemptions > scheduler.num_swap_outs


@pytest.mark.parametrize("chunking", [dict(chunked_prefill=False, max_num_batched_tokens=8),
                                      dict(max_prefill_chunk=3)])
def test_chunk_policy_changes_only_the_steps(reference, chunking):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = tiny()
    for name, value in chunking.items():
        setattr(config.scheduler, name, value)
    with LLM(config) as llm:
        out = llm.generate(PROMPTS, greedy)
        snapshot = llm.core.snapshot()
    assert [c.token_ids for c in out] == reference["greedy"]
    assert snapshot["chunked_prefill"] == chunking.get("chunked_prefill", True)
    assert snapshot["max_prefill_chunk"] == chunking.get("max_prefill_chunk")  # None: whole


def test_penalties_and_logprobs_survive_preemption():
    """Penalised, biased, seeded requests with log-probabilities, run together on a pool so
    small that they are preempted and re-prefilled: every token and every log-probability is
    what each gives alone (the worker rebuilds each one's history from its positions)."""
    # The bias makes token 5 likely; each time it is sampled the frequency penalty makes it
    # less so: the tokens depend on each request's history being right.
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=0.6,
                            min_p=0.02, logit_bias={5: 6.0}, logprobs=2)
    with LLM(tiny()) as llm:
        alone = [llm.generate([p], params)[0] for p in PROMPTS]
    with LLM(tiny(num_blocks=24)) as llm:
        together = llm.generate(PROMPTS, params)
        preemptions = llm.core.scheduler.num_preemptions
    assert preemptions > 0
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        assert [lp.top_token_ids for lp in a.logprobs] == [lp.top_token_ids for lp in b.logprobs]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert 2 <= alone[0].token_ids.count(5) < 20  # biased, and held back by its count
    plain = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    with LLM(tiny()) as llm:
        assert llm.generate([PROMPTS[0]], plain)[0].token_ids != alone[0].token_ids
