"""After a failure, the streams that were generating are recomputed before the prompts that
were cut off mid-prefill, whatever their arrival order. Pure Python, no model."""

from test_scheduler import make_request, make_scheduler, run_step


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
