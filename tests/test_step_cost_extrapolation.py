"""Issue 31 item 4 (a long prompt's cost to the streams beside it) and issue 29 (chunks sized from
the measured step cost): a chunk sized from the step cost fit holds at most EXTRAPOLATION
times the most prompt tokens a measured step has carried. Measured before on SmolLM2 (2 cores,
serve's defaults): after one small warm-up prefill the fit put its prefill cost in the fixed
cost of carrying prefill, so a ~1,000-token prompt went into one step beside two decoding
streams and they waited 2.6 s for a token under a 150 ms ITL target."""

import pytest

from test_scheduler import make_request, make_scheduler, run_step
from tokstream.engine.scheduler.output import step_shape
from tokstream.engine.scheduler.step_cost import (EXTRAPOLATION, PROBE_PREFILL_TOKENS,
                                                  StepCostModel, StepShape)

TARGET_S = 0.150


def smollm2_like(shape: StepShape) -> float:
    """A step's seconds, roughly SmolLM2's on 2 cores: 8 ms fixed, 0.4 ms a decode, 1.2 ms a
    prompt token, 12 ms more for a step that carries prefill."""
    carries = 0.012 if shape.prefill_tokens else 0.0
    return (0.008 + 0.0004 * shape.num_decodes + 0.0012 * shape.prefill_tokens + carries
            + 2e-8 * shape.attended_tokens)


def timed(s):
    out = run_step(s)
    seconds = smollm2_like(step_shape(out.work))
    s.observe_step(out, seconds)
    return out, seconds


def test_one_small_warm_up_does_not_let_a_long_prompt_in_whole():
    s = make_scheduler(num_blocks=4096, block_size=16, budget=2048, max_seqs=16,
                       itl_target_ms=TARGET_S * 1000)
    s.max_model_len = 4096
    for name in ("a", "b"):  # two chat streams: one 80-token warm-up prefill, then decodes
        s.add_request(make_request(name, prompt_len=40, max_tokens=1000, salt=name))
    for _ in range(200):
        timed(s)
    prompt = make_request("long", prompt_len=1000, max_tokens=4, salt="long")
    s.add_request(prompt)
    step_seconds = []
    while prompt.num_computed_tokens < 1000 and len(step_seconds) < 40:
        out, seconds = timed(s)
        assert {w.request.request_id for w in out.work if w.is_decode} == {"a", "b"}
        step_seconds.append(seconds)
    assert prompt.num_computed_tokens >= 1000  # it finishes, in a handful of steps
    # The first chunks probe past the target by a little while the fit learns; no step comes
    # near the whole prompt's 1.2 s, and once learned the steps keep to the target.
    assert max(step_seconds) < 2 * TARGET_S
    assert max(step_seconds[-3:]) <= TARGET_S * 1.05


def test_a_chunk_grows_by_the_extrapolation_factor_from_what_was_measured():
    model = StepCostModel(coefficients=[0.0, 0.0, 1024 * 1e-9, 0.0, 0.0, 0.0])  # ~free tokens
    assert model.prefill_tokens_within(1.0, start=0) == PROBE_PREFILL_TOKENS
    model.observe(StepShape(0, 500, 0), 0.5)
    assert model.prefill_tokens_within(10.0, start=0) == int(EXTRAPOLATION * 500)
    model.observe(StepShape(0, 100, 0), 0.1)  # a smaller step after it: the range stays
    assert model.prefill_tokens_within(10.0, start=0) == int(EXTRAPOLATION * 500)


def test_within_what_was_measured_the_fit_decides():
    model = StepCostModel(coefficients=[0.0, 0.0, 1024 * 1e-3, 0.0, 0.0, 0.0],
                          largest_prefill_tokens=10_000)
    assert model.prefill_tokens_within(0.1, start=0) == pytest.approx(100, abs=1)
