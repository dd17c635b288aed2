"""--speculative auto (issue 34 item 4): each request drafts as many tokens as its recent
acceptance says pay for their rows at the step's batch, from the fitted step cost
(draft_length.py). The rule on hand-made fits and acceptances; the scheduler with step times
fed back from a known cost, output token for token the one plain decoding gives; and the
engine on dummy:tiny, its step cost fitted from real steps."""

import pytest

from test_scheduler import make_scheduler
from test_speculative_scheduler import WorkerTables, copy_requests, model, outputs, rows_of, run
from tokstream.config import EngineConfig, SpeculativeConfig
from tokstream.core_state import Speculation
from tokstream.engine.draft_length import (COLD_START_K, COLD_START_STEPS, LAST_PROBE_AFTER,
                                           Acceptance, StepPrice, choose_draft_length)
from tokstream.engine.llm import LLM
from tokstream.engine.scheduler.step_cost import StepCostModel, StepShape
from tokstream.engine.speculation import Speculator
from tokstream.sampling_params import SamplingParams

K = 4
CHEAP = (20e-3, 1e-4, 1e-4)
"""(fixed, per decode, per other token) seconds of a step: a small model whose step is
mostly reading its weights, so a row is nearly free."""
DEAR = (1e-3, 1e-3, 1e-3)
"""A step that is mostly its rows (a big batch on a busy machine): a row costs about what a
token's share of the step does, so no draft can pay for it."""


def fitted(cost, num_steps=60) -> StepCostModel:
    """A step cost fit that has seen num_steps steps of cost, decode-only and mixed."""
    a, b, c = cost
    model = StepCostModel()
    for i in range(num_steps):
        decodes, prefill = 1 + (7 * i) % 64, (0 if i % 3 else 16 * (1 + i % 5))
        model.observe(StepShape(decodes, prefill, 100 * decodes + 50 * prefill),
                      a + b * decodes + c * prefill)
    return model


def price(cost, num_decodes=64, num_steps=60) -> StepPrice:
    return StepPrice.of(fitted(cost, num_steps), num_decodes, 100 * num_decodes)


def acceptance(rate: float) -> Acceptance:
    """A request whose every position has been accepted at `rate` lately."""
    return Acceptance([5.0 * rate] * K, [5.0] * K)


def after(verifications: int, accepted: int) -> Acceptance:
    """A new request after `verifications` drafts of K with `accepted` of each accepted."""
    state = Acceptance.new(K)
    for _ in range(verifications):
        state.observe(K, accepted)
    return state


# --- the rule ----------------------------------------------------------------------------

def test_the_estimate_is_conditional_per_position_and_starts_at_the_prior():
    state = Acceptance.new(K)
    assert [state.rate(j) for j in range(1, K + 1)] == [0.5] * K
    state.observe(K, 1)  # the first accepted, the second rejected, the rest unseen
    assert state.rate(1) > 0.5 > state.rate(2) and state.rate(3) == state.rate(4) == 0.5
    many = after(30, 0)
    assert many.rate(1) < 0.01 and many.rate(2) == 0.5  # rejected at once: never reached


def test_low_acceptance_drafts_nothing_where_high_acceptance_drafts_all():
    """The same batch and fit: only the requests' acceptance differs."""
    step = price(CHEAP)
    assert 0.1 < step.row_seconds(100, 1) * step.tokens_per_second < 0.5
    assert choose_draft_length(after(6, 0), step, 100, K) == 0
    assert choose_draft_length(after(6, K), step, 100, K) == K


def test_dear_rows_draft_nothing_even_at_high_acceptance():
    state = acceptance(0.95)
    assert choose_draft_length(state, price(DEAR), 100, K) == 0
    assert choose_draft_length(acceptance(0.95), price(CHEAP), 100, K) == K
    assert choose_draft_length(acceptance(0.95), price(DEAR, num_decodes=1), 100, K) == K


def test_each_position_pays_with_the_chance_of_reaching_it():
    """At 0.6 a position the 0.24 a row costs is paid by the first two (0.6, 0.36), not the
    third (0.216): the third is reached only when both before it were accepted."""
    assert choose_draft_length(acceptance(0.6), price(CHEAP), 100, K) == 2
    assert choose_draft_length(acceptance(0.6), price(CHEAP), 100, 1) == 1  # the cap


def test_before_the_fit_knows_anything_k_is_small_and_fixed():
    early = price(DEAR, num_steps=COLD_START_STEPS - 1)
    assert not early.fitted
    assert choose_draft_length(after(6, 0), early, 100, K) == COLD_START_K
    assert choose_draft_length(after(6, 0), early, 100, 1) == 1
    assert choose_draft_length(after(6, 0), None, 100, K) == COLD_START_K
    assert choose_draft_length(after(6, 0), price(DEAR), 100, 0) == 0


def test_rejected_drafts_stop_and_are_probed_ever_more_rarely_until_they_pay_again():
    """200 steps of drafts all rejected, then the answer starts quoting: drafting stops
    within a few steps, one-token probes come at growing intervals, and once the drafts are
    right again the rule drafts several within a few probes."""
    state, step = Acceptance.new(K), price(CHEAP)
    chosen = []
    for _ in range(200):
        k = choose_draft_length(state, step, 100, K)
        chosen.append(k)
        if k:
            state.observe(k, 0)
    stopped = chosen.index(0)
    assert stopped <= 3
    probes = [i for i, k in enumerate(chosen) if i > stopped and k]
    assert all(chosen[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert 4 <= len(probes) <= 7 and gaps == sorted(gaps) and max(gaps) == LAST_PROBE_AFTER
    for resumed in range(1, 3 * LAST_PROBE_AFTER):
        k = choose_draft_length(state, step, 100, K)
        if k > 1:
            break
        if k:
            state.observe(k, k)
    assert k > 1 and resumed <= 2 * LAST_PROBE_AFTER


def test_the_speculator_keeps_each_live_request_s_acceptance_and_forgets_it():
    speculator = Speculator(SpeculativeConfig(method="auto", num_speculative_tokens=K))
    speculator.lengths.choose("a", None, 10, K)
    speculator.verified("a", [1, 2], [1, 3, 4])
    assert speculator.lengths.by_request["a"].rate(1) > 0.5
    speculator.forget("a")
    speculator.verified("a", [1], [1, 2])  # an aborted request's step ends after it
    assert speculator.lengths.by_request == {}
    assert Speculator(SpeculativeConfig(method="ngram")).lengths is None


# --- the scheduler -----------------------------------------------------------------------

def timed_run(s, requests, cost):
    """Step until every request finishes, as run() does, reporting each step's time under
    cost; returns the drafts of each verify after the fit was warm."""
    a, b, c = cost
    for request in requests:
        s.add_request(request)
    live = {r.request_id: r for r in requests}
    tables, warm_drafts, step_id = WorkerTables(), [], 0
    while s.has_work:
        step_id += 1
        assert step_id < 500
        warm = s.step_cost.num_observations >= COLD_START_STEPS
        out = s.schedule()
        plan = out.plan(step_id)
        tables.apply(plan)
        s.update(out, [model(seen) for _, seen in rows_of(plan, live)])
        assert s.check() == []
        drafted = [len(w.draft_token_ids) for w in out.work if w.is_verify]
        if drafted:
            assert s.speculator.last_step_draft_tokens == sum(drafted)
        if warm:
            warm_drafts += drafted
        s.observe_step(out, a + b * out.num_decodes + c * (out.num_tokens - out.num_decodes))
    return warm_drafts


@pytest.mark.parametrize("method", ["auto", "ngram"])
@pytest.mark.parametrize("cost", [CHEAP, DEAR], ids=["cheap-rows", "dear-rows"])
def test_auto_output_equals_plain_decoding_and_follows_the_cost(method, cost):
    plain = copy_requests(max_tokens=60)
    run(make_scheduler(num_blocks=256, budget=64), plain)
    s = make_scheduler(num_blocks=256, budget=64)
    s.speculator = Speculator(SpeculativeConfig(method=method, num_speculative_tokens=K))
    spec = copy_requests(max_tokens=60)
    drafts = timed_run(s, spec, cost)
    assert outputs(spec) == outputs(plain)
    assert s.speculator.stats.num_accepted_tokens > 0
    assert s.block_manager.num_free_blocks == 256 and s.speculator.drafters == {}
    if method == "ngram":  # forced: drafts whatever the cost
        assert max(drafts) == K
    elif cost == CHEAP:
        assert max(drafts) == K and len(set(drafts)) > 1
    else:  # dear rows: only probes once the fit is warm
        assert drafts and set(drafts) == {1}
    if method == "auto":
        assert s.speculator.lengths.by_request == {}


# --- the engine --------------------------------------------------------------------------

PROMPTS = [[5 + i, 17, 99, 3 + i, 42, 8] * (3 + i) for i in range(6)]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def tiny(method: str) -> EngineConfig:
    return EngineConfig(model="dummy:tiny", dtype="float32",
                        speculative=SpeculativeConfig(method=method, num_speculative_tokens=K))


@pytest.mark.startup
@pytest.mark.timeout(300)
def test_the_engine_under_auto_gives_plain_decoding_s_output_and_reports_it():
    with LLM(tiny("off")) as llm:
        plain = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    with LLM(tiny("auto")) as llm:
        out = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        snapshot = llm.core.snapshot()["speculation"]
        assert llm.core.scheduler.step_cost.num_observations >= COLD_START_STEPS
    assert out == plain
    assert snapshot["method"] == "auto" and snapshot["num_draft_tokens"] > 0
    assert isinstance(snapshot["last_step_draft_tokens"], int)
    assert Speculation.from_wire(snapshot).to_wire() == snapshot
