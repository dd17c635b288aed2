"""`n` choices on the OpenAI routes: the engine prefills a prompt shared by a group of requests
once and lets the prefix cache serve it to the others (pure Python, below); through a real
server with the official SDK, n choices streamed and not, each equal to a lone request with
its derived seed, usage summed, a typed 400 outside 1-16, and the integrity checker reading
each choice of a multi-choice stream as its own stream."""

import itertools

from tokstream.config import SchedulerConfig
from tokstream.engine.block_manager import BlockManager
from tokstream.engine.request import Request
from tokstream.engine.scheduler import Scheduler
from tokstream.sampling_params import SamplingParams

_clock = itertools.count()
PROMPT = list(range(100, 140))
"""40 tokens: 10 full blocks of 4 (9 of them shareable: one token is always computed)."""


def group_request(rid, group="cmpl-1", prompt=PROMPT, outputs=()):
    return Request(rid, list(prompt), SamplingParams(max_tokens=16, temperature=0), seed=0,
                   arrival=float(next(_clock)), output_token_ids=list(outputs),
                   prompt_group=group)


def scheduler(budget=256, caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     watermark_blocks=0),
                     BlockManager(64, 4, enable_caching=caching), max_model_len=1000)


def step(s):
    out = s.schedule()
    s.update(out, [7] * sum(w.samples for w in out.work))
    assert s.check() == []
    return out


def prefilled(out):
    return {w.request.request_id: w.num_tokens for w in out.work if w.num_tokens > 1}


def test_a_group_prefills_its_prompt_once_and_shares_its_blocks():
    s = scheduler()
    choices = [group_request(f"cmpl-1-{i}") for i in range(3)]
    for request in choices:
        s.add_request(request)
    # The first choice prefills the prompt alone; the others wait for its blocks to be cached,
    # then compute only the tail the cache cannot hold (the last block's tokens).
    assert prefilled(step(s)) == {"cmpl-1-0": 40}
    assert prefilled(step(s)) == {"cmpl-1-1": 4, "cmpl-1-2": 4}
    shared = choices[0].block_ids[:9]
    assert all(r.block_ids[:9] == shared for r in choices)
    assert all(s.block_manager.ref_counts[b] == 3 for b in shared)
    assert len({r.block_ids[9] for r in choices}) == 3  # each writes its own last block


def test_a_resumed_group_shares_its_prompt_again():
    """Members holding output already (resumed requests), and again after a rank-group restart
    (every one re-prefills prompt + its own output): one of them first, then the others from
    its cached prompt blocks. A request outside the group is not held, except behind a held
    member that was preempted (those come back in order)."""
    s = scheduler()
    choices = [group_request(f"cmpl-1-{i}", outputs=[50 + i] * 6) for i in range(3)]
    other = group_request("other", group="", prompt=list(range(300, 340)))
    for request in [*choices, other]:
        s.add_request(request)
    assert prefilled(step(s)) == {"cmpl-1-0": 46, "other": 40}
    # The prompt is exactly 10 blocks: the others compute their own output tokens only.
    assert prefilled(step(s)) == {"cmpl-1-1": 6, "cmpl-1-2": 6}
    s.requeue_all()  # the pool's contents are gone
    assert prefilled(step(s)) == {"cmpl-1-0": 48}
    assert prefilled(step(s)) == {"cmpl-1-1": 7, "cmpl-1-2": 7, "other": 42}


def test_no_hold_without_a_prefix_cache_or_a_full_block():
    s = scheduler(caching=False)
    for i in range(3):
        s.add_request(group_request(f"cmpl-1-{i}"))
    assert len(prefilled(step(s))) == 3
    s = scheduler()
    for i in range(3):
        s.add_request(group_request(f"cmpl-2-{i}", group="cmpl-2", prompt=[1, 2, 3]))
    assert len(step(s).work) == 3
