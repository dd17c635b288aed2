"""The scheduler after a failure (a new engine core, or a rank group restarted): the streams
that were generating are recomputed before the prompts cut off mid-prefill, whatever their
arrival order, and the recomputation is not held to the ITL target. Pure Python, no model."""

import pytest

from test_scheduler import make_request, make_scheduler, run_step
from test_scheduler_itl_target import (decodes_of, itl_scheduler, make_request as salted,
                                       prefill_tokens, start_decoders, timed_step)
from test_step_cost import trained, truth
from tokstream.engine.scheduler.output import step_shape


def order_admitted(s, steps):
    seen = []
    for _ in range(steps):
        for work in run_step(s).work:
            if work.request.request_id not in seen:
                seen.append(work.request.request_id)
    return seen


def resumed(rid, prompt_len, outputs):
    request = make_request(rid, prompt_len=prompt_len, max_tokens=50, salt=rid)
    request.output_token_ids = [7] * outputs
    request.num_failures = 1  # the gateway counts the core death it resubmits it after
    return request


def test_on_a_new_engine_core_the_streams_that_were_generating_go_first():
    # The long prompt arrived between the two streams, and mid-prefill it would otherwise
    # take a chunk of every step before the second stream is even admitted.
    s = make_scheduler(num_blocks=256, budget=64, max_prefill_chunk=32)
    for request in (resumed("s0", 20, 5), resumed("long", 300, 0), resumed("s1", 20, 5)):
        s.add_request(request)
    assert order_admitted(s, 3) == ["s0", "s1", "long"]


def test_after_a_rank_group_restart_the_streams_that_were_generating_go_first():
    s = make_scheduler(num_blocks=256, budget=64, max_prefill_chunk=32)
    s.add_request(make_request("long", prompt_len=300, max_tokens=4, salt="long"))
    run_step(s)  # the long prompt arrived first and is mid-prefill
    for rid in ("d0", "d1"):
        s.add_request(make_request(rid, prompt_len=8, max_tokens=50, salt=rid))
    for _ in range(3):
        run_step(s)
    assert [r.request_id for r in s.running] == ["long", "d0", "d1"]
    assert s.requests["d0"].output_token_ids and not s.requests["long"].output_token_ids
    s.requeue_all()
    assert [r.request_id for r in s.waiting] == ["d0", "d1", "long"]
    assert order_admitted(s, 2)[:2] == ["d0", "d1"]


def test_a_request_resumed_after_an_engine_core_death_is_not_held_to_the_target():
    # The gateway resubmits every live stream to the new core (num_failures > 0). Those it
    # re-prefills first decode again while the others still recompute: holding the rest to
    # the target would spread a failure's recomputation thin over many steps, every one of
    # them stalled until it is done (measured at --tp 3 on 2 cores: 16 steps, 9 s).
    s = itl_scheduler(target_ms=60.0)
    trained(s.step_cost)
    start_decoders(s, 4)
    resumed = salted("resumed", prompt_len=300, max_tokens=4)
    resumed.num_failures = 1
    s.add_request(resumed)
    assert resumed.recovering
    out = timed_step(s)
    assert len(decodes_of(out)) == 4 and prefill_tokens(out) == 256 - 4  # the whole budget
    while not resumed.output_token_ids:
        timed_step(s)
    assert not resumed.recovering  # from its next token on, a stream like any other
    late = salted("late", prompt_len=300, max_tokens=4)
    s.add_request(late)
    assert not late.recovering
    assert prefill_tokens(timed_step(s)) < 40  # held: 60 ms less 5 decodes' 30 ms


def test_requests_requeued_by_a_rank_group_restart_are_not_held_to_the_target():
    s = itl_scheduler(target_ms=60.0)
    trained(s.step_cost)
    start_decoders(s, 4)
    s.add_request(salted("late", prompt_len=500, max_tokens=4))
    assert prefill_tokens(timed_step(s)) == pytest.approx(32, abs=1)  # held, as it should be
    s.requeue_all()  # the ranks died: every request recomputes prompt + output
    assert all(r.recovering for r in s.requests.values())
    first = timed_step(s)  # nothing decodes yet: the whole budget
    assert not decodes_of(first) and prefill_tokens(first) == 256
    second = timed_step(s)
    late = s.requests["late"]
    assert len(decodes_of(second)) == 4
    assert prefill_tokens(second) == min(252, 500 - late_before(first))
    while not late.output_token_ids:
        timed_step(s)
    assert not any(r.recovering for r in s.requests.values())


def late_before(out):
    return sum(w.num_tokens for w in out.work if w.request.request_id == "late")


def test_a_long_prompt_resumed_after_a_failure_stays_held_to_the_target():
    # Its re-prefill at the whole budget would stall the resumed streams for as many steps
    # as its prefill has chunks: the long-prompt rule comes first.
    s = itl_scheduler(target_ms=60.0, long_prefill_tokens=150)
    s.max_model_len = 4000
    trained(s.step_cost)
    start_decoders(s, 4)
    long = salted("long", prompt_len=1000, max_tokens=4)
    long.num_failures = 1
    s.add_request(long)
    for _ in range(3):
        out = timed_step(s)
        assert len(decodes_of(out)) == 4 and 0 < prefill_tokens(out) <= 33
        assert truth(step_shape(out.work)) <= 0.060 + 0.001


def started_mixed_batch():
    """Two streams decoding and a long prompt part-way through its chunked prefill."""
    s = make_scheduler(num_blocks=128, budget=16, max_prefill_chunk=8)
    for rid in ("d0", "d1"):
        s.add_request(make_request(rid, prompt_len=6, max_tokens=40, salt=rid))
    for _ in range(2):
        run_step(s)
    s.add_request(make_request("long", prompt_len=60, max_tokens=4, salt="long"))
    for _ in range(3):
        run_step(s)
    assert s.requests["d0"].output_token_ids and 0 < s.requests["long"].num_computed_tokens < 60
    return s


def shape(out):
    return [(w.request.request_id, w.start, w.num_tokens) for w in out.work]


def test_a_rank_group_that_kept_the_pool_runs_the_failed_step_again():
    s = started_mixed_batch()
    failed = s.schedule()  # the ranks died in it: update() never ran
    computed = {rid: r.num_computed_tokens for rid, r in s.requests.items()}
    blocks = {rid: list(r.block_ids) for rid, r in s.requests.items()}
    assert s.keep_pool_after_restart(failed)
    assert s.check() == []
    again = run_step(s)
    assert shape(again) == shape(failed)  # the same work, from the same positions
    # Every request is new to the new ranks: they learn its whole block table.
    assert all(w.is_new and w.new_block_ids == w.request.block_ids for w in again.work)
    assert all(s.requests[rid].block_ids[:len(held)] == held for rid, held in blocks.items())
    assert all(w.start == computed[w.request.request_id] for w in again.work)
    assert not any(r.recovering for r in s.requests.values())  # nothing is recomputed
    assert not any(w.is_new for w in run_step(s).work)  # told once


def test_a_running_request_left_out_of_the_first_step_is_new_at_its_own():
    s = started_mixed_batch()
    s.keep_pool_after_restart(s.schedule())
    s.config.max_num_batched_tokens = 2  # room for the two decodes only
    assert {w.request.request_id for w in run_step(s).work} == {"d0", "d1"}
    s.config.max_num_batched_tokens = 16
    late = [w for w in run_step(s).work if w.request.request_id == "long"]
    assert late and late[0].is_new and late[0].new_block_ids == s.requests["long"].block_ids


def test_host_blocks_in_play_mean_the_pool_is_not_trusted():
    # Host buffers die with their ranks, and the failed step's copies may not have run.
    s = started_mixed_batch()
    failed = s.schedule()
    failed.swap_in = [(0, 5)]
    assert not s.keep_pool_after_restart(failed)
    assert not s.unknown_to_workers  # nothing changed: the caller requeues everything
