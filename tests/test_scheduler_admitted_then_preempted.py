"""A request admitted into a step must not be preempted later in that same step: its chunk is
already in the step's work. Found by the old-vs-new equality test of issue 33 item 2 (both
schedulers did it): admission does not mark what it starts as given work (StepDraft.scheduled),
so the long prefills' pass that follows the short prompts' admission may pick the request it
just admitted as its victim. The step then carries the chunk of a preempted request, its new
blocks already handed to the long prompt (both chunks write the same block), and update()
fails on it (IndexError in cache_full_blocks, with prefix caching on). Fixed after that item:
admission adds what it starts to StepDraft.scheduled."""

from tokstream.engine.request import RequestStatus
from test_scheduler import make_request, make_scheduler, run_step


def test_a_request_admitted_in_a_step_is_not_its_victim():
    # Seven blocks of 4 tokens; prompts past 8 tokens are long and, while a short prompt
    # waits, take half of the 16-token budget.
    s = make_scheduler(num_blocks=7, block_size=4, budget=16, long_prefill_tokens=8,
                       long_prefill_share=0.5)
    s.add_request(make_request("long", prompt_len=24, max_tokens=2))
    run_step(s)  # its first 16 tokens: four blocks
    s.add_request(make_request("short", prompt_len=8, max_tokens=2))
    out = s.schedule()
    # The short prompt starts (two blocks, one left), then the long one's last 8 tokens need
    # two: the pool is dry, and the victim must not be the short prompt, whose chunk is in
    # the step (the long prompt itself waits instead).
    assert "short" not in [r.request_id for r in out.preempted]
    assert all(w.request.status == RequestStatus.RUNNING for w in out.work)
    s.update(out, [7 for w in out.work if w.samples])
    assert s.check() == []
