"""The ITL target: a step cost learned from measured steps sizes each step's prefill share.
Pure Python: hand-built step times fed to the scheduler (the cost model's own tests are in
test_step_cost.py)."""

import pytest

from test_scheduler import make_request as _make_request, make_scheduler, run_step
from test_step_cost import random_shapes, trained, truth
from tokstream.engine.scheduler.output import step_shape
from tokstream.engine.scheduler.step_cost import StepCostModel
from tokstream.errors import UserInputError

# truth(): the machine these tests pretend to run on, 20 ms a step, 2 ms a decode and 1 ms a
# prompt token (test_step_cost.py).


def make_request(rid, **kwargs):
    # Salted apart: no prompt here shares a cached prefix with another.
    return _make_request(rid, salt=rid, **kwargs)


def timed_step(s, slowdown=1.0):
    """One scheduler step whose measured time is truth(), fed back as the engine core does."""
    out = run_step(s)
    s.observe_step(out, truth(step_shape(out.work), slowdown))
    return out


def prefill_tokens(out):
    return sum(w.num_tokens for w in out.work) - len(decodes_of(out))


def decodes_of(out):
    return [w for w in out.work if w.num_tokens == 1 and w.samples]


def itl_scheduler(target_ms=60.0, **config):
    return make_scheduler(num_blocks=1024, budget=256, max_seqs=16, itl_target_ms=target_ms,
                          **config)


def start_decoders(s, n=4, max_tokens=400):
    """n streams that decode from the next step on (prefilled in one step, nothing decoding)."""
    for i in range(n):
        s.add_request(make_request(f"d{i}", prompt_len=8, max_tokens=max_tokens))
    out = timed_step(s)
    assert prefill_tokens(out) == 8 * n


@pytest.mark.parametrize("dearer_decode, expected_tokens", [(0.0, 22), (0.001, 18)])
def test_the_cost_of_carrying_prefill_is_learned_and_kept_within_the_target(dearer_decode,
                                                                           expected_tokens):
    # A step with any prefill pays 10 ms more, and maybe more a decode (on CPU: the per-layer
    # path instead of the one-call decode stack); the fit must learn it, and the steps that
    # carry prefill still fit the target.
    def mixed_truth(shape):
        extra = 0.010 + dearer_decode * shape.num_decodes if shape.prefill_tokens else 0.0
        return truth(shape) + extra

    s = itl_scheduler(target_ms=60.0)
    for i in range(4):  # as start_decoders, timed by this machine
        s.add_request(make_request(f"d{i}", prompt_len=8, max_tokens=400))
    s.observe_step(run_step(s), 0.0)
    s.prefill_policy.step_cost = StepCostModel()
    for shape in random_shapes(80):
        s.step_cost.observe(shape, mixed_truth(shape))
    assert s.step_cost.prefill_switch_seconds(4) == pytest.approx(0.010 + 4 * dearer_decode,
                                                                 abs=0.001)
    s.add_request(make_request("prompt", prompt_len=500, max_tokens=4))
    for _ in range(5):
        out = run_step(s)
        s.observe_step(out, mixed_truth(step_shape(out.work)))
        # 20 ms fixed and 4 x 2 ms of decodes leave 32 ms; carrying prefill costs 10 ms (and
        # 4 ms more for the decodes): 22 (18) tokens at 1 ms each.
        assert prefill_tokens(out) == pytest.approx(expected_tokens, abs=1)
        assert mixed_truth(step_shape(out.work)) <= 0.060 + 0.001


def test_a_burst_of_prompts_goes_in_first_come_first_served():
    # Six 100-token prompts arrive together. Once the first have their first token they
    # decode, but the target does not hold the rest back for them: those arrived with them,
    # so every step fills its budget with prefill until all six are in (a stream is protected
    # only from prompts that arrive after its first token).
    s = itl_scheduler(target_ms=60.0)
    trained(s.step_cost)
    for i in range(6):
        s.add_request(make_request(f"burst{i}", prompt_len=100, max_tokens=50))
    steps = [timed_step(s) for _ in range(3)]
    # 600 prompt tokens: 256, then 2 decodes + 254, then 5 decodes + the last 90
    assert [(len(decodes_of(out)), prefill_tokens(out)) for out in steps] == [
        (0, 256), (2, 254), (5, 90)]
    # a prompt arriving now is held to the target for the six streams
    s.add_request(make_request("late", prompt_len=100, max_tokens=4))
    out = timed_step(s)
    assert len(decodes_of(out)) == 6 and truth(step_shape(out.work)) <= 0.060 + 0.001


def test_a_long_prompt_is_held_to_the_target_even_when_it_came_first():
    # A long prompt arrives with a short one. The short one is in after the first step and
    # decodes; the long prompt's chunks then ride its steps, and first come first served would
    # let each fill the budget, so a stream would wait on a long prefill every step of it
    # (measured: chat ITL of seconds behind 8k-token prompts). A long prompt never exempts.
    s = itl_scheduler(target_ms=60.0, long_prefill_tokens=150)
    s.max_model_len = 4000
    trained(s.step_cost)
    s.add_request(make_request("short", prompt_len=50, max_tokens=50))
    s.add_request(make_request("long", prompt_len=1000, max_tokens=4))
    assert not decodes_of(timed_step(s))  # both prompts start; nothing decodes yet
    for _ in range(6):
        out = timed_step(s)
        assert len(decodes_of(out)) == 1 and prefill_tokens(out) > 0
        assert truth(step_shape(out.work)) <= 0.060 + 0.001


def test_a_long_prefill_leaves_the_prefill_time_to_a_short_prompt_first():
    # A long prompt mid-prefill would take the whole prefill time the target leaves, step
    # after step, and a chat prompt arriving behind it would wait for all of it (measured,
    # long-prompt-flood on SmolLM2: chat TTFT p90 22 s). Short prompts' prefill goes first
    # (issue 29; it used to get what long_prefill_share of the time left): the short prompt
    # takes all the time the target leaves, the long one had it the steps before.
    s = itl_scheduler(target_ms=60.0, long_prefill_tokens=150, long_prefill_share=0.5)
    s.max_model_len = 4000
    trained(s.step_cost)
    start_decoders(s, 4)
    s.add_request(make_request("long", prompt_len=1000, max_tokens=4))
    timed_step(s)
    timed_step(s)
    s.add_request(make_request("short", prompt_len=50, max_tokens=4))
    out = timed_step(s)
    chunks = {w.request.request_id: w.num_tokens for w in out.work if w.num_tokens > 1}
    assert chunks.get("short", 0) == pytest.approx(32, abs=1) and "long" not in chunks
    assert truth(step_shape(out.work)) <= 0.060 + 0.001


def test_the_prefill_share_fits_the_target():
    s = itl_scheduler(target_ms=60.0)
    trained(s.step_cost)
    start_decoders(s, 4)
    s.add_request(make_request("prompt", prompt_len=500, max_tokens=4))
    for _ in range(5):
        out = timed_step(s)
        assert len(decodes_of(out)) == 4
        # 20 ms + 4 x 2 ms of decodes leave 32 ms: 32 prompt tokens at 1 ms each.
        assert prefill_tokens(out) == pytest.approx(32, abs=1)
        assert truth(step_shape(out.work)) <= 0.060 + 0.001


def test_the_prefill_share_shrinks_when_steps_get_slower():
    s = itl_scheduler(target_ms=60.0, itl_min_prefill_share=0.0)  # no floor to hit
    s.max_model_len = 4000
    trained(s.step_cost)
    start_decoders(s, 4, max_tokens=1000)
    s.add_request(make_request("prompt", prompt_len=3000, max_tokens=4))
    shares = [prefill_tokens(timed_step(s)) for _ in range(12)]
    assert shares == [32] * 12 or shares == [31] * 12  # 32 ms at 1 ms, give or take rounding
    slow = [prefill_tokens(timed_step(s, slowdown=1.5)) for _ in range(40)]
    # 1.5x slower: 42 ms of decodes leave 18 ms, 12 tokens at 1.5 ms.
    assert slow[-1] == pytest.approx(12, abs=1)
    assert all(later <= earlier + 1 for earlier, later in zip(slow, slow[1:]))


def test_with_nothing_decoding_prefill_takes_the_whole_budget():
    s = itl_scheduler(target_ms=30.0)
    trained(s.step_cost)
    for i in range(4):
        s.add_request(make_request(f"p{i}", prompt_len=200))
    out = timed_step(s)
    assert not decodes_of(out) and prefill_tokens(out) == 256


def test_the_floor_keeps_prompts_moving_when_decodes_alone_pass_the_target():
    # 12 decodes take 44 ms, past the 30 ms target: prefill still gets a quarter of it.
    s = itl_scheduler(target_ms=30.0, itl_min_prefill_share=0.25)
    trained(s.step_cost)
    start_decoders(s, 12)
    s.add_request(make_request("waiting", prompt_len=70, max_tokens=4))
    steps = 0
    while not s.requests["waiting"].output_token_ids:
        out = timed_step(s)
        steps += 1
        assert prefill_tokens(out) == min(7, 70 - 7 * (steps - 1))  # 7.5 ms at 1 ms a token
    assert steps == 10


def test_with_no_floor_a_waiting_prompt_still_gets_a_token_every_step():
    s = itl_scheduler(target_ms=30.0, itl_min_prefill_share=0.0)
    trained(s.step_cost)
    start_decoders(s, 12)
    s.add_request(make_request("waiting", prompt_len=5, max_tokens=4))
    for step in range(5):
        out = timed_step(s)
        assert [w.num_tokens for w in out.work if w.request.request_id == "waiting"] == [1]
    assert s.requests["waiting"].output_token_ids == [7]


def test_the_long_prefill_share_still_applies_under_the_target():
    s = make_scheduler(num_blocks=1024, budget=64, max_seqs=8, long_prefill_tokens=16,
                       itl_target_ms=1000.0)
    trained(s.step_cost)
    s.add_request(make_request("long", prompt_len=300))
    timed_step(s)
    s.add_request(make_request("chat", prompt_len=10))
    out = timed_step(s)
    assert [(w.request.request_id, w.num_tokens) for w in out.work] == [("long", 32),
                                                                        ("chat", 10)]


def trace(s, arrivals, steps=120, slowdown=1.0):
    """Chunks of every step, requests arriving at given steps; step times fed back."""
    chunks = []
    for step in range(steps):
        for request in arrivals.get(step, []):
            request.arrival = s.clock()  # it arrives now, after the earlier steps' tokens
            s.add_request(request)
        out = timed_step(s, slowdown)
        chunks.append([(w.request.request_id, w.start, w.num_tokens) for w in out.work]
                      + [("preempted", r.request_id) for r in out.preempted])
    return chunks


def mixed_arrivals():
    return {0: [make_request("a", prompt_len=40, max_tokens=60)],
            3: [make_request(f"b{i}", prompt_len=90, max_tokens=30) for i in range(5)],
            9: [make_request("long", prompt_len=600, max_tokens=10)],
            20: [make_request(f"c{i}", prompt_len=20, max_tokens=50) for i in range(3)]}


@pytest.mark.parametrize("chunking", [True, False])
def test_with_the_target_off_nothing_changes(chunking):
    # Small pool and budget: chunking, the long-prefill share and preemption all act.
    def scheduler(**config):
        return make_scheduler(num_blocks=60, budget=64, max_seqs=6, chunked_prefill=chunking,
                              long_prefill_tokens=200, **config)

    reference = scheduler(itl_target_ms=0)
    reference.observe_step = lambda out, seconds: None  # never learns a step cost
    expected = trace(reference, mixed_arrivals())
    assert any(step and step[-1][0] == "preempted" for step in expected)
    assert trace(scheduler(itl_target_ms=0), mixed_arrivals(), slowdown=50.0) == expected
    on = trace(scheduler(itl_target_ms=30.0), mixed_arrivals())
    assert (on == expected) == (not chunking)  # the target needs chunks to size


def test_under_overload_decoders_keep_the_target_and_the_rest_wait_or_are_refused():
    from tokstream.gateway_config import AdmissionConfig
    from tokstream.server.access.gateway_admission import Admission
    from tokstream.server.api_errors import ANTHROPIC, OPENAI, ApiError, error_response

    s = itl_scheduler(target_ms=60.0)
    trained(s.step_cost)
    start_decoders(s, 4, max_tokens=1000)
    admission = Admission(AdmissionConfig(max_waiting_requests=8))
    waiting: dict[str, int] = {}  # as the gateway counts: submitted, no token yet
    refused, first_token_step = [], {}
    for step in range(150):
        for i in range(2):  # two 100-token prompts a step: far more than 32 tokens a step
            request = make_request(f"r{step}.{i}", prompt_len=100, max_tokens=3)
            try:
                admission.check(100)
            except ApiError as error:
                refused.append(error)
                continue
            admission.enter(100)
            waiting[request.request_id] = step
            s.add_request(request)
        out = timed_step(s)
        assert len(decodes_of(out)) >= 4
        assert truth(step_shape(out.work)) <= 0.060 + 0.001 * 2  # 2 decodes join in a step
        for work in out.work:
            rid = work.request.request_id
            if rid in waiting and work.request.output_token_ids:
                admission.leave(100, waited_s=1.0)
                first_token_step[rid] = step - waiting.pop(rid)
    assert refused and all(e.error_type == "overloaded_error" and e.retry_after >= 1
                           for e in refused)
    assert error_response(ANTHROPIC, refused[0]).status_code == 529
    assert error_response(OPENAI, refused[0]).status_code == 503
    assert "retry-after" in error_response(OPENAI, refused[0]).headers
    # Nobody admitted starves: each waits its turn behind at most 8 others of 100 tokens
    # each, at ~30 prompt tokens a step.
    assert len(first_token_step) > 20 and max(first_token_step.values()) <= 40
    assert min(waiting.values()) > 150 - 40  # and those still waiting arrived lately


@pytest.mark.parametrize("bad", [dict(itl_target_ms=-1), dict(itl_min_prefill_share=-0.1),
                                 dict(itl_min_prefill_share=1.5)])
def test_bad_itl_settings_are_refused(bad):
    with pytest.raises(UserInputError, match="itl_"):
        make_scheduler(**bad)


def test_the_flag_and_the_profile_key_reach_the_scheduler(monkeypatch):
    from typer.testing import CliRunner

    import tokstream.server.startup
    from tokstream.cli import app
    from tokstream.config import SchedulerConfig
    from tokstream.settings import build_settings

    engine, _ = build_settings({"scheduler": {"itl_target_ms": 150}}, {})
    assert engine.scheduler.itl_target_ms == 150
    engine, _ = build_settings({"scheduler": {"itl_target_ms": 150}},
                               {"scheduler": {"itl_target_ms": 0.0}})
    assert engine.scheduler.itl_target_ms == 0  # 0 is a value (off), not "unset"
    seen = []
    monkeypatch.setattr(tokstream.server.startup, "run", lambda engine, server, **_: seen.append(
        engine.scheduler.itl_target_ms))
    runner = CliRunner()
    assert runner.invoke(app, ["serve", "--itl-target-ms", "120"]).exit_code == 0
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert seen == [120.0, SchedulerConfig().itl_target_ms]
    help_text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "--itl-target-ms" in help_text
    assert f"[default: ({SchedulerConfig().itl_target_ms:g})]" in help_text


@pytest.mark.startup
def test_the_engine_core_feeds_every_step_to_the_cost_model_and_outputs_do_not_change():
    # dummy:tiny with a real worker: a target far under its step time leaves prefill only the
    # floor, so prompts that arrive while a stream decodes go in small chunks; the tokens are
    # the same as with the target off.
    from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from tokstream.engine.llm import LLM
    from tokstream.sampling_params import SamplingParams

    prompts = [[5 + i, 17, 99, 3 + i] * (i + 2) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model="dummy:tiny", dtype="float32",
                          cache=CacheConfig(block_size=4, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(itl_target_ms=0.0),
                          speculative=SpeculativeConfig(method="off"))  # a token a step

    def run(llm):
        """The first prompt decodes; then the rest arrive. Returns the tokens, the steps taken
        and the most tokens in one step."""
        core, first_step, most = llm.core, llm.core.step_id, 0
        tokens = {}
        for index, prompt in enumerate(prompts):
            # The first one decodes until every other prompt is in.
            request = llm.request(prompt, long if index == 0 else params)
            tokens[request.request_id] = []
            core.add_request(request)
            while index == 0 and not tokens[request.request_id]:
                for delta in core.step():
                    tokens[delta.request_id] += delta.token_ids
        while core.has_work:
            for delta in core.step():
                tokens[delta.request_id] += delta.token_ids
            most = max(most, core.last_step.num_tokens)
        return list(tokens.values()), core.step_id - first_step, most

    with LLM(config) as llm:
        off, steps_off, most_off = run(llm)
        assert llm.core.scheduler.step_cost.num_observations == steps_off
        llm.core.config.scheduler.itl_target_ms = 1e-3  # the scheduler reads its config live
        on, steps_on, most_on = run(llm)
        assert on == off and [len(t) for t in on] == [150] + [12] * 5
        assert llm.core.scheduler.step_cost.num_observations == steps_off + steps_on
        # 100 prompt tokens at one a step (the floor of a ~0 target) beside the decodes; with
        # the target off they went in one step.
        assert most_off == 1 + 100 and most_on <= 1 + 5 + 1
