"""Background requests (a Message Batch's) beside interactive ones: at most
background_rows_when_busy of them a step while chat runs, the rest keeping their blocks, none
starting, all running again once chat ends. Pure Python, no model."""

import pytest

from test_scheduler import make_request, make_scheduler, run_step
from tokstream.engine.request import RequestStatus


def background(rid, **kwargs):
    request = make_request(rid, **kwargs)
    request.background, request.priority = True, 1_000_000
    return request


def stepped(out) -> set[str]:
    return {w.request.request_id for w in out.work}


@pytest.mark.parametrize("room", [0, 1])
def test_background_requests_use_the_steps_chat_does_not_need(room):
    """A Message Batch's requests run beside interactive ones at most
    background_rows_when_busy at a time (0: not at all), keeping their blocks while they
    wait, and run freely once no interactive request is left."""
    s = make_scheduler(num_blocks=256, background_rows_when_busy=room)
    batch = [background(f"b{i}", max_tokens=40) for i in range(3)]
    for request in batch:
        s.add_request(request)
    assert stepped(run_step(s)) == {"b0", "b1", "b2"}  # alone: every one runs
    chat = make_request("chat", max_tokens=6)
    s.add_request(chat)
    assert "chat" in stepped(run_step(s))  # admitted into the step it arrives for
    held = [r.output_token_ids[:] for r in batch]
    while chat.status == RequestStatus.RUNNING:
        ran = stepped(run_step(s))
        assert "chat" in ran and len(ran & {"b0", "b1", "b2"}) == room, ran
        assert all(r.status == RequestStatus.RUNNING and r.block_ids for r in batch)
    assert chat.output_token_ids == [7] * 6
    moved = [len(r.output_token_ids) - len(h) for r, h in zip(batch, held)]
    assert (moved[0] > 0) == (room == 1) and moved[1:] == [0, 0], moved
    assert stepped(run_step(s)) == {"b0", "b1", "b2"}  # chat gone: all run again


def test_background_requests_wait_to_start_while_chat_runs():
    s = make_scheduler(num_blocks=256)
    s.add_request(make_request("chat", max_tokens=5))
    run_step(s)
    late = background("late", max_tokens=4)
    s.add_request(late)
    for _ in range(4):
        assert stepped(run_step(s)) == {"chat"}
    assert late.status == RequestStatus.WAITING and not late.block_ids
    for _ in range(10):
        run_step(s)
    assert late.output_token_ids == [7] * 4
