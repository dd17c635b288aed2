"""Penalties and logit_bias survive every interruption: penalised, biased requests (greedy and
seeded) preempted on a tiny pool (recomputed, or swapped to host memory and back), resumed
after their rank is SIGKILLed, and resumed from
prompt + delivered tokens (what a new engine core is given after the old one died) produce
exactly the tokens of an uninterrupted run. The worker rebuilds each request's penalty state
from its tokens by position: the prompt for the repetition penalty, the output (delivered
before the interruption included) for all three."""

import os
import signal

import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

PROMPTS = [[5 + i, 17, 99, 3 + i] * (i + 2) for i in range(4)]
PENALTIES = dict(max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                 frequency_penalty=1.0, presence_penalty=0.6, logit_bias={5: 6.0, 9: 3.0})
# The bias makes tokens 5 and 9 likely; each time one is sampled the penalties make it less
# so: the tokens depend on each request's history being right.
PARAMS = [SamplingParams(temperature=0.0, **PENALTIES),
          SamplingParams(temperature=0.9, seed=3, **PENALTIES)]
NUM_BLOCKS = 20
"""Blocks of 4 tokens: the longest request alone needs 10, all four together about 30."""


def requests(tag: str, delivered=None) -> list[EngineRequest]:
    """Each prompt with greedy and with seeded params; delivered: tokens already streamed."""
    return [EngineRequest(f"{tag}{i}-{j}", prompt, params,
                          output_token_ids=list(delivered[(i, j)]) if delivered else [])
            for i, prompt in enumerate(PROMPTS) for j, params in enumerate(PARAMS)]


def run(llm, reqs, fault=None) -> dict[tuple[int, int], list[int]]:
    """(prompt, params) -> the tokens streamed; fault(llm, tokens) runs after every delta."""
    tokens = {r.request_id: [] for r in reqs}
    already = {r.request_id: len(r.output_token_ids) for r in reqs}
    for delta in llm.stream(reqs):
        received = tokens[delta.request_id]
        assert delta.first_index == already[delta.request_id] + len(received)  # in order
        received += delta.token_ids
        if fault is not None:
            fault(llm, tokens)
    return {tuple(map(int, rid[1:].split("-"))): out for rid, out in tokens.items()}


def tiny_pool(**cache) -> EngineConfig:
    return EngineConfig(model="dummy:tiny", dtype="float32",
                        cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS, **cache),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_pool()) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(llm) -> dict[tuple[int, int], list[int]]:
    """Every request run by itself: nothing preempts or interrupts it."""
    out = {}
    for request in requests("a"):
        out.update(run(llm, [request]))
    assert llm.core.scheduler.num_preemptions == 0
    return out


def test_the_penalties_and_bias_shape_the_output(alone):
    assert all(len(tokens) == 24 for tokens in alone.values())
    counts = [tokens.count(5) + tokens.count(9) for tokens in alone.values()]
    assert min(counts) >= 2 and max(counts) < 16  # biased, and held back by the penalties


def test_preempted_requests_equal_uninterrupted_ones(llm, alone):
    before = llm.core.scheduler.num_preemptions
    together = run(llm, requests("p"))
    assert llm.core.scheduler.num_preemptions > before
    assert together == alone


def test_requests_swapped_out_and_back_equal_uninterrupted_ones(alone):
    """Swap-mode preemption: the KV comes back from host memory, so the worker is sent the
    history of positions it is not sent again."""
    with LLM(tiny_pool(preemption_mode="swap", swap_space=2**24)) as swapping:
        together = run(swapping, requests("s"))
        assert swapping.core.scheduler.num_swap_outs > 0
    assert together == alone


def test_requests_resumed_after_a_rank_kill_equal_uninterrupted_ones(llm, alone):
    restarts, killed = llm.core.recovery.restarts, []

    def kill_mid_decode(llm, tokens):
        if not killed and len(tokens["k0-0"]) >= 6:
            killed.append(llm.core.executor.pids[0])
            os.kill(killed[0], signal.SIGKILL)

    resumed = run(llm, requests("k"), kill_mid_decode)
    assert killed and llm.core.recovery.restarts == restarts + 1
    assert resumed == alone


def test_requests_resumed_from_delivered_tokens_equal_uninterrupted_ones(llm, alone):
    """After an engine core dies the gateway submits prompt + every delivered token to the
    new core: the penalties must count the delivered tokens as output."""
    delivered = {key: tokens[:7 + key[0]] for key, tokens in alone.items()}
    rest = run(llm, requests("d", delivered))
    assert {key: delivered[key] + tokens for key, tokens in rest.items()} == alone
