"""Long prefills in steps of their own (issue 29 item 2, SchedulerConfig.long_prefill_alone):
while streams decode, a long prompt's chunks run in prefill steps between decode steps, each
held so that a decode step and the prefill step after it stay within long_prefill_step_ms.
Pure Python: hand-built step times fed to the scheduler, on a clock of their own."""

from test_scheduler import make_request as plain_request
from test_scheduler_itl_target import decodes_of, make_request, prefill_tokens, start_decoders
from test_scheduler_latency_classes import arrive, chunk_of, scheduler, step
from test_step_cost import truth
from tokstream.config import SchedulerConfig
from tokstream.engine.scheduler.output import step_shape


def test_the_defaults_run_long_prefills_alone_within_60_ms():
    config = SchedulerConfig()
    assert config.long_prefill_alone and config.long_prefill_step_ms == 60.0


def alone(**config):
    # The target is 60 ms; each step costs 20 ms + 2 ms a decode + 1 ms a prompt token.
    return scheduler(long_prefill_alone=True, long_prefill_step_ms=60.0, **config)


def test_decode_steps_and_prefill_steps_alternate_within_the_long_step_time():
    s = alone()
    start_decoders(s, 2)
    arrive(s, make_request("long", prompt_len=2000, max_tokens=4))
    gaps, kinds = [], []
    previous = None
    for _ in range(12):
        out = step(s)
        seconds = truth(step_shape(out.work))
        decoding = bool(decodes_of(out))
        kinds.append("decode" if decoding else "prefill")
        if decoding:
            assert chunk_of(out, "long") == 0  # long chunks stay out of the decodes' steps
            assert len(decodes_of(out)) == 2
        else:
            assert chunk_of(out, "long") > 0 and prefill_tokens(out) == chunk_of(out, "long")
            if previous is not None:
                gaps.append(previous + seconds)  # what a stream waits: the two steps
        previous = seconds
    assert kinds[:6] == ["prefill", "decode"] * 3 or kinds[:6] == ["decode", "prefill"] * 3
    assert gaps and max(gaps) <= 0.060 + 0.001


def test_the_long_prompt_finishes_and_the_streams_keep_decoding():
    s = alone()
    start_decoders(s, 2, max_tokens=10_000)
    arrive(s, make_request("long", prompt_len=1500, max_tokens=2))
    for _ in range(400):
        step(s)
        if "long" not in s.requests:
            break
    assert "long" not in s.requests  # prefilled and finished
    assert all(len(s.requests[f"d{i}"].output_token_ids) > 20 for i in range(2))


def test_a_short_prompt_starts_in_a_prefill_step_never_in_a_decode_step():
    # A stream's gap is a decode step and the prefill step after it: a chat prompt's chunk in
    # the decode step would lengthen that gap past long_prefill_step_ms, so it waits for a
    # prefill step, where it goes before the long chunk unless the long prompt is owed its
    # share (then the next prefill step but one).
    for warmup in (2, 3):  # it arrives before a decode step, and before a prefill step
        s = alone()
        start_decoders(s, 2)
        arrive(s, make_request("long", prompt_len=2000, max_tokens=4))
        for _ in range(warmup):
            step(s)
        arrive(s, make_request("chat", prompt_len=10, max_tokens=4))
        for taken in range(1, 5):
            out = step(s)
            if chunk_of(out, "chat"):
                break
            if decodes_of(out):
                assert prefill_tokens(out) == 0
        assert not decodes_of(out) and chunk_of(out, "chat") == 10, taken
        assert s.requests["chat"].output_token_ids == [7]


def test_with_nothing_decoding_a_long_prompt_runs_in_ordinary_steps():
    s = alone()
    arrive(s, make_request("long", prompt_len=2000, max_tokens=4))
    for _ in range(4):
        out = step(s)
        assert chunk_of(out, "long") > 0
    assert s.prefill_policy.last_step_alone is False


def test_off_long_chunks_share_the_decodes_steps():
    s = scheduler(long_prefill_alone=False, long_prefill_step_ms=60.0)
    start_decoders(s, 2)
    arrive(s, make_request("long", prompt_len=2000, max_tokens=4))
    for _ in range(4):
        out = step(s)
        assert len(decodes_of(out)) == 2 and chunk_of(out, "long") > 0


def test_a_prefill_step_never_preempts_a_stream_that_decodes():
    # The long prompt arrived first, so the streams are behind it in running order: when the
    # pool runs dry in a prefill step, the victim must be a request given work in it (the
    # long prompt), never a stream the step gave nothing to do.
    s = alone()
    s.block_manager.__init__(num_blocks=160, block_size=4, enable_caching=True)
    arrive(s, make_request("long", prompt_len=600, max_tokens=2))
    for i in range(2):
        s.clock.now += 1.0
        arrive(s, make_request(f"d{i}", prompt_len=8, max_tokens=300))
    victims_in_prefill_steps = []
    for _ in range(150):
        out = step(s)
        if not decodes_of(out):
            victims_in_prefill_steps += [r.request_id for r in out.preempted]
    assert victims_in_prefill_steps and set(victims_in_prefill_steps) == {"long"}


def test_a_prompt_behind_a_cached_prefix_is_short_and_shares_the_decodes_step():
    # 400 shared tokens are long (past 150); once they are cached, a second prompt behind them
    # has 3 tokens to compute: short, so it starts beside the decodes at once instead of
    # waiting for a prefill step (measured: the shared-prefix mix's TTFT p50 went 4.3 -> 12.2 s
    # while waiting requests were classed by their whole length).
    s = alone()
    shared = list(range(5000, 5400))
    arrive(s, plain_request("first", prompt=shared + [1, 2, 3], max_tokens=300))
    while not s.requests["first"].output_token_ids:
        step(s)
    arrive(s, plain_request("second", prompt=shared + [4, 5, 6], max_tokens=4))
    out = step(s)
    assert decodes_of(out) and chunk_of(out, "second") == 3
    assert s.requests["second"].output_token_ids == [7]
