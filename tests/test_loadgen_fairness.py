"""Fairness against demand: max-min fair shares (water-filling) on hand-built numbers, and the
report's fairness block on the hot-tenant shape the raw index misreads."""

import random

import pytest

from tokstream.errors import UserInputError
from tokstream.loadgen.fairness import TenantShare, fairness, tenant_shares, water_fill
from tokstream.stats import jain_index
from tokstream.loadgen.mix import parse_mix


def test_a_tenant_asking_less_than_its_share_gets_all_it_asked_and_the_rest_split_evenly():
    # 9 to share: an equal share is 3; a asks 1, so b and c split the other 8
    assert water_fill({"a": 1.0, "b": 10.0, "c": 10.0}, 9.0) == {"a": 1.0, "b": 4.0, "c": 4.0}
    # cascading: a (1) fits the first level (3); then b (3.5) fits the second (8 / 2 = 4);
    # c takes what is left
    assert water_fill({"a": 1.0, "b": 3.5, "c": 10.0}, 9.0) == {"a": 1.0, "b": 3.5, "c": 4.5}
    # everyone fits: each gets its demand, and the unused capacity is nobody's
    assert water_fill({"a": 1.0, "b": 2.0}, 10.0) == {"a": 1.0, "b": 2.0}
    # nobody fits: an equal split
    assert water_fill({"a": 5.0, "b": 7.0, "c": 9.0}, 6.0) == {"a": 2.0, "b": 2.0, "c": 2.0}
    # a tenant that asked nothing is owed nothing; nothing to share, nothing shared
    assert water_fill({"a": 0.0, "b": 4.0}, 3.0) == {"a": 0.0, "b": 3.0}
    assert water_fill({"a": 1.0, "b": 4.0}, 0.0) == {"a": 0.0, "b": 0.0}


def test_weights_split_what_is_left_in_proportion():
    # weights 2:1, both asking more than 9: 6 and 3
    assert water_fill({"a": 10.0, "b": 10.0}, 9.0, {"a": 2.0, "b": 1.0}) == {"a": 6.0, "b": 3.0}
    # level 9 / 4 = 2.25: a (weight 2) is offered 4.5 and asks 1; b and c split the other 8
    assert water_fill({"a": 1.0, "b": 10.0, "c": 10.0}, 9.0, {"a": 2.0}) == \
        {"a": 1.0, "b": 4.0, "c": 4.0}
    # b (weight 3) is offered 3 x 12 / 4 = 9 and asks 5: a gets the other 7 (below its 8)
    assert water_fill({"a": 8.0, "b": 5.0}, 12.0, {"a": 1.0, "b": 3.0}) == {"a": 7.0, "b": 5.0}
    with pytest.raises(ValueError, match="weights"):
        water_fill({"a": 1.0}, 1.0, {"a": 0.0})
    with pytest.raises(ValueError, match="negative"):
        water_fill({"a": -1.0}, 1.0)


def test_water_filling_is_max_min_fair_on_random_demands():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 6)
        demands = {f"t{k}": rng.choice([0.0, rng.uniform(0, 10)]) for k in range(n)}
        weights = {t: rng.choice([1.0, 2.0, 0.5]) for t in demands}
        capacity = rng.uniform(0, 30)
        share = water_fill(demands, capacity, weights)
        assert sum(share.values()) == pytest.approx(min(capacity, sum(demands.values())))
        assert all(-1e-12 <= share[t] <= demands[t] + 1e-9 for t in demands)
        # max-min: any tenant short of its demand has the highest share per weight of all
        short = [t for t in demands if share[t] < demands[t] - 1e-9]
        if short:
            level = max(share[t] / weights[t] for t in short)
            assert all(share[t] / weights[t] <= level + 1e-9 for t in demands)
            assert all(share[t] / weights[t] == pytest.approx(level) for t in short)


def request(tenant: str, sent_at: float, first_token_at: float | None, prompt: int = 100,
            max_tokens: int = 30, gap: float = 0.1) -> dict:
    """A sample sent at `sent_at` (run seconds) whose max_tokens output tokens came one per
    `gap` seconds from `first_token_at` (None: none came)."""
    times = [] if first_token_at is None else [first_token_at + n * gap - sent_at
                                               for n in range(max_tokens)]
    return {"tenant": tenant, "start_s": sent_at, "prompt_tokens": prompt,
            "max_tokens": max_tokens, "event_times_s": times, "event_tokens": [1] * len(times),
            "e2e_s": (times[-1] if times else 1.0)}


def blocks(samples: list[dict], raw_tokens: dict[str, float], ttft: dict[str, float]) -> dict:
    """Per-tenant summary blocks as report.summarize makes them (the fields fairness reads):
    whole-run tokens/s (`raw_tokens` over 10 s) and p50 TTFT."""
    return {t: {"requests": sum(1 for s in samples if s["tenant"] == t),
                "total_tokens_per_s": raw_tokens[t] / 10.0, "ttft_s": {"p50": ttft[t]}}
            for t in raw_tokens}


COLD = ("cold-1", "cold-2", "cold-3")
RAW = {"hot": 1300.0, **{t: 130.0 for t in COLD}}
"""Whole-run tokens served once everything drained: all that each tenant asked (10:1:1:1)."""


def hot_tenant_run(cold_first_token_at: float, hot_served_in_window: int) -> list[dict]:
    """The hot-tenant shape over a 10 s load window (first send at 0, last at 10): hot sends
    10 requests of 130 tokens, each cold tenant one. `hot_served_in_window` of hot's requests
    stream all their tokens by t = 10; the others get their first token after it."""
    hot = [request("hot", 0.0, 0.5 + 0.5 * n if n < hot_served_in_window else 10.5)
           for n in range(9)] + [request("hot", 10.0, 10.5)]
    return hot + [request(t, 0.0, cold_first_token_at) for t in COLD]


def test_a_fair_server_reads_fair_under_a_hot_tenant():
    # the cold requests go first (done by t = 4); 5 of hot's stream in full by t = 10
    samples = hot_tenant_run(cold_first_token_at=1.0, hot_served_in_window=5)
    ttft = {"hot": 24.7, "cold-1": 3.2, "cold-2": 3.9, "cold-3": 3.5}
    figures = fairness(samples, blocks(samples, RAW, ttft))
    assert figures["tenants"] == 4 and figures["window_s"] == [0.0, 10.0]
    # the raw index reads the demand, not the server: 169 / 412 for 10:1:1:1
    assert figures["jain_index_raw_tokens"] == pytest.approx(169 / 412)
    # against demand it is fair: in the window hot asked 1,300 tokens and each cold tenant 130;
    # 1,040 were served: each cold tenant all it asked, hot the other 650, its max-min share
    assert figures["jain_index_fair_share"] == pytest.approx(1.0)
    assert figures["min_fair_share_ratio"] == pytest.approx(1.0)
    shares = figures["per_tenant"]
    assert shares["hot"]["demand_tokens_per_s"] == 130.0
    assert shares["cold-1"]["demand_tokens_per_s"] == 13.0
    assert shares["hot"]["achieved_tokens_per_s"] == 65.0
    assert shares["hot"]["fair_share_tokens_per_s"] == pytest.approx(65.0)
    assert shares["cold-2"]["fair_share_tokens_per_s"] == pytest.approx(13.0)
    assert shares["cold-3"]["achieved_tokens_per_s"] == 13.0


def test_first_come_first_served_reads_unfair_against_demand():
    # hot's requests go first: 7 stream in full by t = 10 (910 tokens); the cold ones start at
    # t = 9.05 and have 10 of their 30 output tokens by then (110 each). Everything drains in
    # the end, so the whole run's tokens are the same as the fair server's
    samples = hot_tenant_run(cold_first_token_at=9.05, hot_served_in_window=7)
    figures = fairness(samples, blocks(samples, RAW, {t: 10.0 for t in RAW}))
    assert figures["jain_index_raw_tokens"] == pytest.approx(169 / 412)  # no different
    # 1,240 served in the window: an equal share (310) covers each cold tenant's 130, so they
    # are owed all of it; hot's share is the other 850
    shares = figures["per_tenant"]
    assert shares["cold-1"]["fair_share_tokens_per_s"] == pytest.approx(13.0)
    assert shares["hot"]["fair_share_tokens_per_s"] == pytest.approx(85.0)
    ratios = [91 / 85] + [11 / 13] * 3
    assert figures["jain_index_fair_share"] == pytest.approx(jain_index(ratios))
    assert figures["min_fair_share_ratio"] == pytest.approx(11 / 13)
    assert shares["cold-1"]["ratio"] == pytest.approx(11 / 13)


def test_tenants_that_sent_nothing_are_left_out_and_weights_apply():
    # a 1 s window. a asks 100 tokens and is served its prompt and 10 tokens (60); b asks 50 + 50
    # and is served 20 + 10 of its first request (30), nothing of the one sent at the end
    samples = [request("a", 0.0, 0.505, prompt=50, max_tokens=50, gap=0.05),
               request("b", 0.0, 0.505, prompt=20, max_tokens=30, gap=0.05),
               request("b", 1.0, None, prompt=30, max_tokens=20)]
    weights = {"a": 2.0, "b": 1.0, "idle": 1.0}
    shares = tenant_shares(samples, weights)
    assert set(shares) == {"a", "b"}  # idle sent nothing: no demand, no share
    # 90 served; weight 2:1 gives a 60 and b 30, each what it got
    assert shares["a"] == TenantShare(100.0, 60.0, 60.0, 2.0)
    assert shares["b"] == TenantShare(100.0, 30.0, 30.0, 1.0)
    per_tenant = blocks(samples, {"a": 60.0, "b": 30.0, "idle": 0.0},
                        {"a": 1.0, "b": 1.0, "idle": None})
    figures = fairness(samples, per_tenant, weights)
    assert figures["tenants"] == 2 and figures["jain_index_fair_share"] == pytest.approx(1.0)
    even = fairness(samples, per_tenant)  # equal weights: 45 each; a over, b under
    assert even["min_fair_share_ratio"] == pytest.approx(30 / 45)
    assert fairness(samples[:1], blocks(samples[:1], {"a": 60.0}, {"a": 1.0}))[
        "jain_index_fair_share"] is None  # one tenant: nothing to compare


def test_mix_tenant_weights_are_parsed_and_checked():
    base = {"kind": "mix", "class": [{"name": "a"}], "tenants": {"x": 1, "y": 3}}
    mix = parse_mix({**base, "tenant_weights": {"x": 2}}, "w")
    assert mix.tenant_weights == {"x": 2.0, "y": 1.0}
    assert parse_mix(base, "w").tenant_weights is None
    with pytest.raises(UserInputError, match="not in \\[tenants\\]"):
        parse_mix({**base, "tenant_weights": {"z": 1}}, "w")
    with pytest.raises(UserInputError, match="positive weight"):
        parse_mix({**base, "tenant_weights": {"x": 0}}, "w")


def test_the_report_weighs_fair_shares_by_the_mixs_tenant_weights():
    from test_loadgen_metrics import trace
    from tokstream.loadgen.report import build_report, complete_sample

    # the load window is 0-3 s (first send to last): a asks 205 tokens and is served all 205;
    # b asks 204 and is served 103 (b's last request failed, one token came after t = 3)
    raw = [trace(0, "a", 0.0, [1.0, 1.5, 2.0], 2.0, 3), trace(1, "a", 1.0, [1.0, 2.0], 3.0, 2),
           trace(2, "b", 2.0, [0.5, 0.75, 1.0, 1.25], 1.5, 4),
           trace(3, "b", 3.0, [], 1.0, 0, status="error")]
    samples = [complete_sample(r) for r in raw]
    mix = {"classes": [{"name": "chat"}], "tenants": {"a": 1, "b": 1}}
    even = build_report(samples, {"mix": mix}, {}, {})["summary"]["fairness"]
    assert even["min_fair_share_ratio"] == pytest.approx(103 / 154)  # b short of half of 308
    # with weight 3, a's share (3/4 of 308) covers all it asked: b's share is the other 103
    weighted = build_report(samples, {"mix": {**mix, "tenant_weights": {"a": 3.0, "b": 1.0}}},
                            {}, {})
    fairness = weighted["summary"]["fairness"]
    assert fairness["per_tenant"]["a"]["weight"] == 3.0
    assert fairness["per_tenant"]["b"]["fair_share_tokens_per_s"] == pytest.approx(103 / 3)
    assert fairness["jain_index_fair_share"] == pytest.approx(1.0)
    assert weighted["tenant"]["b"]["fair_share"]["ratio"] == pytest.approx(1.0)
