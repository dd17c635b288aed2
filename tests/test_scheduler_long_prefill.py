"""Long prefills yield part of the budget to shorter prompts that wait (pure Python)."""

import pytest

from test_scheduler import make_request, make_scheduler, run_step
from tokstream.errors import UserInputError


def chunks(out):
    return [(w.request.request_id, w.start, w.num_tokens) for w in out.work]


def long_scheduler(**config):
    # budget 64, prefills with more than 16 tokens left are long, long ones get half.
    config = {"long_prefill_tokens": 16, "long_prefill_share": 0.5, **config}
    return make_scheduler(num_blocks=256, budget=64, max_seqs=8, **config)


def test_a_long_prefill_alone_takes_the_whole_budget():
    s = long_scheduler()
    s.add_request(make_request("long", prompt_len=300))
    assert chunks(run_step(s)) == [("long", 0, 64)]
    assert chunks(run_step(s)) == [("long", 64, 64)]


def test_a_short_prompt_starts_at_once_beside_a_long_prefill():
    s = long_scheduler()
    s.add_request(make_request("long", prompt_len=300))
    run_step(s)
    s.add_request(make_request("chat", prompt_len=10))
    out = run_step(s)
    assert chunks(out) == [("long", 64, 32), ("chat", 0, 10)]
    assert s.requests["chat"].output_token_ids == [7]  # its first token, this step
    # Nothing short waits any more: the long prefill has the rest of the budget again.
    assert chunks(run_step(s)) == [("chat", 10, 1), ("long", 96, 63)]


def test_short_prompts_pass_long_ones_waiting_ahead_of_them():
    s = long_scheduler()
    for rid, length in (("long1", 300), ("long2", 300), ("chat", 10)):
        s.add_request(make_request(rid, prompt_len=length))
    # The short prompt is admitted first (issue 29: short prompts before long chunks).
    assert chunks(run_step(s)) == [("chat", 0, 10), ("long1", 0, 32)]
    # The second long prompt starts once nothing short waits.
    assert chunks(run_step(s)) == [("chat", 10, 1), ("long1", 32, 63)]
    assert chunks(run_step(s)) == [("chat", 11, 1), ("long1", 95, 63)]


def test_share_one_keeps_first_come_first_served():
    s = long_scheduler(long_prefill_share=1.0)
    s.add_request(make_request("long", prompt_len=300))
    run_step(s)
    s.add_request(make_request("chat", prompt_len=10))
    assert chunks(run_step(s)) == [("long", 64, 64)]


def test_no_limit_without_chunking():
    s = long_scheduler(chunked_prefill=False)
    s.add_request(make_request("long", prompt_len=300))
    s.add_request(make_request("chat", prompt_len=10))
    assert chunks(run_step(s)) == [("long", 0, 300)]


@pytest.mark.parametrize("bad", [dict(long_prefill_share=0), dict(long_prefill_share=1.5),
                                 dict(long_prefill_tokens=0)])
def test_bad_long_prefill_settings_are_refused(bad):
    with pytest.raises(UserInputError, match="long_prefill"):
        make_scheduler(**bad)



def with_priority(request, priority):
    request.priority = priority
    return request


def test_decodes_go_before_a_more_important_long_prefill():
    # chat generates; then a long prompt of a more important tier runs ahead of it in running
    # order. Its chunks must not take the token chat needs each step.
    s = long_scheduler(long_prefill_share=1.0)
    s.add_request(with_priority(make_request("chat", prompt_len=10, max_tokens=20), 1))
    run_step(s)
    s.add_request(make_request("long", prompt_len=300))
    assert chunks(run_step(s)) == [("chat", 10, 1), ("long", 0, 63)]
    for step in range(3):
        assert chunks(run_step(s)) == [("chat", 11 + step, 1), ("long", 63 + 63 * step, 63)]


def test_preemption_spares_a_request_already_given_work_this_step():
    # Pool of 5 blocks of 4 tokens. chat (less important) decodes; long's next chunk does not
    # fit: the victim is long itself, not chat, whose decode is already in the step.
    s = make_scheduler(num_blocks=5, block_size=4, budget=8, long_prefill_share=1.0)
    s.add_request(with_priority(make_request("chat", prompt_len=8, max_tokens=20), 1))
    run_step(s)
    s.add_request(make_request("long", prompt_len=16))
    assert chunks(run_step(s)) == [("chat", 8, 1), ("long", 0, 7)]
    out = run_step(s)
    assert chunks(out) == [("chat", 9, 1)]
    assert [r.request_id for r in out.preempted] == ["long"]
    assert s.requests["chat"].output_token_ids == [7, 7, 7]
