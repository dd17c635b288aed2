"""Two latency classes (issue 29): short prompts' prefill goes before long prompts' chunks, a
long chunk is sized from the step cost so its step stays within the target whether or not
streams decode, and long prefills get a guaranteed share of the prefill time per second.
Pure Python: hand-built step times fed to the scheduler, on a clock of their own."""

import pytest

from test_scheduler import make_scheduler, run_step
from test_scheduler_itl_target import decodes_of, make_request, prefill_tokens, start_decoders
from test_step_cost import trained, truth
from tokstream.engine.scheduler.output import step_shape
from tokstream.errors import UserInputError


class Clock:
    """The scheduler's clock, advanced by each step's time (arrivals are stamped with it)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(**config):
    config = {"long_prefill_tokens": 150, "itl_target_ms": 60.0, **config}
    s = make_scheduler(num_blocks=4096, budget=256, max_seqs=16, **config)
    s.max_model_len = 8000
    s.clock = Clock()
    trained(s.step_cost)
    return s


def step(s):
    """One step; its truth() time is fed back and the clock moves on by it."""
    out = run_step(s)
    seconds = truth(step_shape(out.work))
    s.observe_step(out, seconds)
    s.clock.now += seconds
    return out


def arrive(s, request):
    request.arrival = s.clock()
    s.add_request(request)


def chunk_of(out, rid):
    return sum(w.num_tokens for w in out.work if w.request.request_id == rid)


def test_a_short_prompt_goes_before_the_chunks_of_three_long_prompts():
    # Three long prompts mid-prefill beside four streams. Each used to take half of the time
    # the one before it left (7/8 in all): a chat prompt got 1/8 of the step and waited steps
    # for its first token. Now its prefill comes first: its first token is out this step.
    s = scheduler()
    start_decoders(s, 4)
    for i in range(3):
        arrive(s, make_request(f"long{i}", prompt_len=2000, max_tokens=4))
    for _ in range(3):
        step(s)
    arrive(s, make_request("chat", prompt_len=24, max_tokens=4))
    out = step(s)
    assert chunk_of(out, "chat") == 24 and s.requests["chat"].output_token_ids == [7]
    assert truth(step_shape(out.work)) <= 0.060 + 0.001
    assert s.prefill_policy.long_first is False


def test_a_long_prompts_last_chunks_stay_in_the_long_class():
    # 300 tokens, long past 150: once fewer than 150 are left its chunks, the dearest (deep in
    # the prompt), must still come after a short prompt's.
    s = scheduler()
    start_decoders(s, 4)
    arrive(s, make_request("long", prompt_len=300, max_tokens=4))
    while s.requests["long"].num_computed_tokens < 200:
        step(s)
    arrive(s, make_request("chat", prompt_len=24, max_tokens=4))
    out = step(s)
    assert chunk_of(out, "chat") == 24 and s.requests["chat"].output_token_ids == [7]


def test_a_long_chunk_keeps_its_step_within_the_target_with_nothing_decoding():
    # Alone, a long prompt used to take the whole budget (256 tokens at 1 ms: a 276 ms
    # step), and a chat prompt arriving during it waited all of it.
    s = scheduler()
    arrive(s, make_request("long", prompt_len=2000, max_tokens=4))
    for _ in range(3):
        out = step(s)
        assert not decodes_of(out) and 0 < prefill_tokens(out) < 256
        assert truth(step_shape(out.work)) <= 0.060 + 0.001
    arrive(s, make_request("chat", prompt_len=24, max_tokens=4))
    step(s)
    assert s.requests["chat"].output_token_ids == [7]


def test_long_prefill_step_ms_sets_the_long_chunks_step_time():
    s = scheduler(long_prefill_step_ms=30.0, itl_min_prefill_share=0.0)  # no floor to hit
    start_decoders(s, 2)
    arrive(s, make_request("long", prompt_len=2000, max_tokens=4))
    for _ in range(4):
        out = step(s)
        assert len(decodes_of(out)) == 2 and prefill_tokens(out) > 0
        assert truth(step_shape(out.work)) <= 0.030 + 0.001


def test_a_short_prompt_is_not_held_to_the_long_chunks_step_time():
    s = scheduler(long_prefill_step_ms=30.0)
    start_decoders(s, 2)
    arrive(s, make_request("chat", prompt_len=30, max_tokens=4))
    out = step(s)
    assert chunk_of(out, "chat") == 30  # 20 + 2 x 2 + 30 ms: within the 60 ms target


def test_long_prefills_behind_their_share_per_second_go_first():
    # A crowd of short prompts takes all the prefill time for a while; then the long prompt
    # is behind long_prefill_share of the last second's prefill time and its chunk goes
    # first, taking the whole step's prefill time (it used to get half of it every step,
    # never more, however long it had waited).
    s = scheduler(long_prefill_share=0.5)
    start_decoders(s, 2, max_tokens=1000)
    arrive(s, make_request("long", prompt_len=3000, max_tokens=4))
    step(s)
    for i in range(12):
        arrive(s, make_request(f"chat{i}", prompt_len=34, max_tokens=200))
    owed = None
    for _ in range(30):
        out = step(s)
        if s.prefill_policy.long_first:
            owed = out
            break
    assert owed is not None
    assert chunk_of(owed, "long") == prefill_tokens(owed) > 0


def test_long_prefills_get_their_share_of_the_prefill_time_under_a_stream_of_short_ones():
    s = scheduler(long_prefill_share=0.5)
    start_decoders(s, 2, max_tokens=2000)
    arrive(s, make_request("long", prompt_len=4000, max_tokens=4))
    long_s = short_s = 0.0
    for n in range(150):
        if n % 2 == 0:  # more short prompts than the steps can take
            arrive(s, make_request(f"chat{n}", prompt_len=34, max_tokens=2))
        out = step(s)
        for work in out.work:
            if not work.is_decode:
                seconds = s.step_cost.prefill_seconds(work.start, work.num_tokens)
                if work.request.request_id == "long":
                    long_s += seconds
                else:
                    short_s += seconds
    assert long_s / (long_s + short_s) == pytest.approx(0.5, abs=0.1)


def test_a_burst_of_short_prompts_goes_in_whole_when_long_prefills_had_their_share():
    # Long prefills had the prefill time to themselves: a few short prompts arriving
    # together take a step's prefill whole, none held back for the long chunk.
    s = scheduler(long_prefill_share=0.5)
    start_decoders(s, 2)
    arrive(s, make_request("long", prompt_len=3000, max_tokens=4))
    for _ in range(6):
        step(s)
    for i in range(3):
        arrive(s, make_request(f"chat{i}", prompt_len=10, max_tokens=4))
    out = step(s)
    assert [chunk_of(out, f"chat{i}") for i in range(3)] == [10, 10, 10]
    assert not s.prefill_policy.long_first


def test_the_policy_is_in_the_state_snapshot():
    from tokstream.engine.core_snapshot import prefill_policy

    s = scheduler(long_prefill_share=0.5, long_prefill_step_ms=40.0)
    start_decoders(s, 2)
    arrive(s, make_request("long", prompt_len=2000, max_tokens=4))
    for _ in range(4):
        step(s)
    arrive(s, make_request("chat", prompt_len=24, max_tokens=4))
    policy = prefill_policy(s)
    assert policy["long_prefill_tokens"] == 150 and policy["long_prefill_share"] == 0.5
    assert policy["long_step_ms"] == 40.0 and policy["long_first"] is False
    assert policy["long_share"] > 0.5  # the long prompt had the prefill time since the first
    assert [(r["id"], r["held"]) for r in policy["long_prefills"]] == [("long", True)]
    left = 2000 - s.requests["long"].num_computed_tokens
    assert policy["long_prefills"][0]["left_tokens"] == left


@pytest.mark.parametrize("bad", [dict(long_prefill_step_ms=-1)])
def test_bad_long_prefill_step_is_refused(bad):
    with pytest.raises(UserInputError, match="long_prefill_step_ms"):
        make_scheduler(**bad)
