"""Swap preemption, pure Python as in test_scheduler.py: a preempted request's KV blocks copied
to host memory and back in (preemption_mode "swap"), recompute when the host space is short,
and what an abort or a lost rank group does to the host copies."""

import pytest

from test_scheduler import make_request, make_scheduler, run_step
from tokstream.config import CacheConfig
from tokstream.engine.request import RequestStatus
from tokstream.errors import UserInputError


@pytest.mark.parametrize("bad", [
    dict(preemption_mode="disk"), dict(preemption_mode="swap", swap_space=0),
    dict(swap_space=-1)])
def test_bad_preemption_settings_are_refused(bad):
    with pytest.raises(UserInputError, match="preemption_mode|swap_space"):
        CacheConfig(**bad)


def run_to_end(s, steps=200):
    outs = []
    for _ in range(steps):
        if not s.has_work:
            break
        outs.append(run_step(s))
    return outs


def test_swap_keeps_the_kv_and_resumes_without_recompute():
    # Same squeeze as test_scheduler.py's recompute test: 6 blocks of 4 tokens, two growing
    # requests.
    s = make_scheduler(num_blocks=6, block_size=4, swap_blocks=16)
    a = make_request("a", prompt_len=8, max_tokens=14)
    b = make_request("b", prompt_len=8, max_tokens=14)
    s.add_request(a)
    s.add_request(b)
    swapped_out, swapped_in, resumed = [], [], []
    while s.has_work:
        out = run_step(s)
        for r in out.preempted:
            assert r is b and r.is_swapped
            # The host copy covers exactly the tokens computed so far, which stay counted.
            assert len(r.swapped_block_ids) == s.block_manager.blocks_for(r.num_computed_tokens)
            swapped_out.append([host for _, host in out.swap_out])
            assert r.swapped_block_ids == swapped_out[-1]
        if out.swap_in:
            swapped_in.append([host for host, _ in out.swap_in])
            work = [w for w in out.work if w.is_new and w.request is b]
            assert work and [pool for _, pool in out.swap_in] == b.block_ids[:len(out.swap_in)]
            resumed.append((work[0].start, work[0].num_tokens, work[0].samples))
    assert swapped_out and swapped_in == swapped_out
    # Re-admitted where it left off: only the last sampled token is computed, no prompt.
    assert resumed and all(start > 8 and num == 1 and samples
                       for start, num, samples in resumed)
    assert a.output_token_ids == [7] * 14 and b.output_token_ids == [7] * 14
    assert s.num_swap_outs == s.num_preemptions > 0
    assert s.swap_space.num_free_blocks == 16 and s.block_manager.num_free_blocks == 6


def test_swap_falls_back_to_recompute_when_host_space_is_short():
    s = make_scheduler(num_blocks=6, block_size=4, swap_blocks=1)
    a = make_request("a", prompt_len=8, max_tokens=14)
    b = make_request("b", prompt_len=8, max_tokens=14)
    s.add_request(a)
    s.add_request(b)
    outs = run_to_end(s)
    assert s.num_preemptions > 0 and s.num_swap_outs == 0
    assert not any(out.swap_out or out.swap_in for out in outs)
    assert b.output_token_ids == [7] * 14 and s.swap_space.num_free_blocks == 1


def test_aborting_a_swapped_request_frees_its_host_blocks():
    s = make_scheduler(num_blocks=6, block_size=4, swap_blocks=16)
    a = make_request("a", prompt_len=8, max_tokens=14)
    b = make_request("b", prompt_len=8, max_tokens=14)
    s.add_request(a)
    s.add_request(b)
    for _ in range(40):
        run_step(s)
        if b.is_swapped:
            break
    assert b.is_swapped and s.swap_space.num_free_blocks < 16
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert s.swap_space.num_free_blocks == 16 and not b.is_swapped
    run_to_end(s)
    assert a.output_token_ids == [7] * 14


def test_requeue_after_a_lost_rank_group_drops_swapped_kv_and_its_host_blocks():
    s = make_scheduler(num_blocks=6, block_size=4, swap_blocks=16)
    a = make_request("a", prompt_len=8, max_tokens=14)
    b = make_request("b", prompt_len=8, max_tokens=14)
    s.add_request(a)
    s.add_request(b)
    while not b.is_swapped:
        run_step(s)
    s.requeue_all()  # the host copies died with the ranks
    assert not b.is_swapped and b.num_computed_tokens == 0
    assert s.swap_space.num_free_blocks == 16 and s.block_manager.num_free_blocks == 6
    outs = run_to_end(s)
    assert not any(out.swap_in for out in outs)
    assert a.output_token_ids == [7] * 14 and b.output_token_ids == [7] * 14
