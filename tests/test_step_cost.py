"""The step cost model the ITL target sizes prefill with: a fit of measured step times to the
step's shape (decodes, prefill tokens, attended tokens), pure Python on hand-built step times.
truth() here is the machine the scheduler's ITL-target tests pretend to run on as well."""

import random

import pytest

from tokstream.engine.scheduler.step_cost import StepCostModel, StepShape, attended_tokens

# The machine the tests pretend to run on: seconds per step, per decode, per prefill token.
A, B, C = 0.020, 0.002, 0.001


def truth(shape: StepShape, slowdown: float = 1.0) -> float:
    return slowdown * (A + B * shape.num_decodes + C * shape.prefill_tokens)


def random_shapes(n, seed=0, max_decodes=32, max_prefill=512):
    rng = random.Random(seed)
    for _ in range(n):
        decodes = rng.randrange(0, max_decodes)
        prefill = rng.choice([0, rng.randrange(1, max_prefill)])
        start = rng.randrange(0, 4000)
        attended = decodes * rng.randrange(1, 4000) + attended_tokens(start, prefill)
        yield StepShape(decodes, prefill, attended)


def trained(model: StepCostModel, steps=60, slowdown=1.0) -> StepCostModel:
    for shape in random_shapes(steps):
        model.observe(shape, truth(shape, slowdown))
    return model


def test_fit_recovers_known_coefficients():
    a, b, c, d = 0.03, 0.004, 0.001, 2e-8
    exact, noisy = StepCostModel(), StepCostModel()
    rng = random.Random(1)
    for shape in random_shapes(300, max_decodes=40, max_prefill=1024):
        seconds = (a + b * shape.num_decodes + c * shape.prefill_tokens
                   + d * shape.attended_tokens)
        exact.observe(shape, seconds)
        noisy.observe(shape, seconds * (1 + rng.gauss(0, 0.03)))
    assert exact.intercept_s == pytest.approx(a, rel=1e-3)
    assert exact.per_decode_s == pytest.approx(b, rel=1e-3)
    assert exact.per_prefill_token_s == pytest.approx(c, rel=1e-3)
    assert exact.per_attended_token_s == pytest.approx(d, rel=1e-2)
    assert noisy.per_decode_s == pytest.approx(b, rel=0.15)
    assert noisy.per_prefill_token_s == pytest.approx(c, rel=0.15)
    probe = StepShape(16, 300, 16 * 500 + attended_tokens(1000, 300))
    assert noisy.predict(probe) == pytest.approx(
        a + b * 16 + c * 300 + d * probe.attended_tokens, rel=0.05)


def test_fit_keeps_every_coefficient_at_or_above_zero():
    # Steps with more prefill happen to run a hair faster: an unconstrained fit would say
    # prefill tokens have negative cost, and the scheduler would hand out unlimited prefill.
    model = StepCostModel()
    for shape in random_shapes(100):
        model.observe(shape, 0.05 + 0.002 * shape.num_decodes - 1e-6 * shape.prefill_tokens)
    assert min(model.coefficients) >= 0
    assert model.per_prefill_token_s == 0
    assert model.per_decode_s == pytest.approx(0.002, rel=0.05)


def test_an_outlier_step_barely_moves_the_fit():
    model = trained(StepCostModel())
    probe = StepShape(8, 100, 0)
    before = model.predict(probe)
    model.observe(probe, 50 * truth(probe))  # a pause: swap, GC, a recompile
    assert model.predict(probe) == pytest.approx(before, rel=0.1)


def test_a_term_recent_steps_do_not_exercise_keeps_its_last_estimate():
    model = trained(StepCostModel())
    for step in range(1000):  # decode-only steps for a long while
        shape = StepShape(8 + step % 8, 0, 0)
        model.observe(shape, truth(shape))
    assert model.per_prefill_token_s == pytest.approx(C, rel=0.05)


def test_the_fit_follows_a_machine_that_gets_slower():
    model = trained(StepCostModel())
    probe = StepShape(8, 100, 0)
    for shape in random_shapes(40, seed=5):  # the fit remembers ~20 steps
        model.observe(shape, truth(shape, slowdown=2.0))
    assert model.predict(probe) == pytest.approx(truth(probe, slowdown=2.0), rel=0.1)


def test_a_chunk_deep_in_a_prompt_gets_fewer_tokens_for_the_same_time():
    model = StepCostModel(coefficients=[0.0, 0.0, 1024 * 1e-3, float(1 << 20) * 1e-6],
                          largest_prefill_tokens=1 << 20)  # no extrapolation limit here
    shallow = model.prefill_tokens_within(0.1, start=0)
    deep = model.prefill_tokens_within(0.1, start=4000)
    assert deep < shallow / 4
    for start, n in ((0, shallow), (4000, deep)):
        assert model.prefill_seconds(start, n) <= 0.1 < model.prefill_seconds(start, n + 1)
