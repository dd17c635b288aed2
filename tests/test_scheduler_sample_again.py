"""A request whose rank held its rows back (its grammar still compiling on rank 0, issue 31
item 4) is computed again from its last position: Scheduler.update(unsampled=...) counts that
position as not computed, so the next step gives it a one-token decode that samples, its
drafts' blocks go back and the workers' block tables follow. Pure Python, hand-fed results
(the fake rank and the next-token rule of test_speculative_scheduler.py): the output is plain
decoding's, token for token, and the other requests decode while it is held."""

import pytest

from tokstream.engine.request import RequestStatus
from test_scheduler import make_scheduler
from test_speculative_scheduler import (WorkerTables, copy_requests, model, outputs, rows_of,
                                        run, spec_scheduler)

HELD_STEPS = 5


def run_holding(s, requests, held_id: str, held_steps: int) -> tuple[list[int], int]:
    """Step until every request finishes; the fake rank holds held_id back at each of the
    first held_steps steps that would sample it. Returns the others' token counts at each
    held step, and the drafts the held chunks carried."""
    for request in requests:
        s.add_request(request)
    live = {r.request_id: r for r in requests}
    tables = WorkerTables()
    others_at_held, held_drafts = [], 0
    step_id = 0
    while s.has_work:
        step_id += 1
        assert step_id < 2000
        out = s.schedule()
        plan = out.plan(step_id)
        tables.apply(plan)
        for work in out.work:
            assert tables.tables[work.request.request_id] == work.request.block_ids
        held = any(c.request_id == held_id and c.sample_index is not None
                   for c in plan.chunks) and len(others_at_held) < held_steps
        rows = [(chunk, seen) for chunk, seen in rows_of(plan, live)
                if not (held and chunk.request_id == held_id)]
        s.update(out, [model(seen) for _, seen in rows], {held_id} if held else set())
        assert s.check() == []
        if held:
            held_drafts += sum(c.num_draft_tokens for c in plan.chunks
                               if c.request_id == held_id)
            others_at_held.append(sum(r.num_output_tokens for r in requests
                                      if r.request_id != held_id))
            request = live[held_id]
            assert request.num_output_tokens == 0
            assert request.num_computed_tokens == request.num_tokens - 1
            # With speculation the blocks of its drafts (and of the last position, where that
            # starts a block) go back at once; without, the workers are never told of fewer.
            kept = request.num_tokens - (1 if s.speculator is not None else 0)
            assert len(request.block_ids) == s.block_manager.blocks_for(kept)
    return others_at_held, held_drafts


@pytest.mark.parametrize("speculative", [False, True])
def test_a_held_request_samples_later_with_plain_decodings_output(speculative):
    plain = copy_requests()
    run(make_scheduler(num_blocks=128, budget=64), plain)
    s = (spec_scheduler if speculative else make_scheduler)(num_blocks=128, budget=64)
    held = copy_requests()
    others, held_drafts = run_holding(s, held, "r2", HELD_STEPS)
    assert outputs(held) == outputs(plain)
    assert len(others) == HELD_STEPS
    assert others == sorted(others) and others[-1] > others[0]  # they decoded meanwhile
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in held)
    assert s.block_manager.num_free_blocks == 128
    if speculative:  # held verify chunks gave their drafts' blocks back
        assert held_drafts > 0 and s.speculator.stats.num_accepted_tokens > 0


def test_a_held_request_is_a_decode_of_its_last_prompt_token():
    s = make_scheduler(num_blocks=64, budget=64)
    [a, b] = copy_requests(2, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [w.samples for w in out.work] == [True, True]
    s.update(out, [7], {b.request_id})  # b's row was held: one token, a's
    assert a.output_token_ids == [7] and b.output_token_ids == []
    assert b.num_computed_tokens == len(b.prompt_token_ids) - 1
    out = s.schedule()
    [work_b] = [w for w in out.work if w.request is b]
    assert (work_b.start, work_b.num_tokens, work_b.is_decode) == (b.num_tokens - 1, 1, True)
    [chunk] = [c for c in out.plan(2).chunks if c.request_id == b.request_id]
    assert (chunk.token_ids, chunk.sample_index) == ([b.prompt_token_ids[-1]], 0)
