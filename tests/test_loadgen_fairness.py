"""Fairness against demand: max-min fair shares (water-filling) on hand-built numbers, and the
report's fairness block on the hot-tenant shape the raw index misreads."""

import random

import pytest

from tokstream.errors import UserInputError
from tokstream.loadgen.fairness import TenantShare, fairness, tenant_shares, water_fill
from tokstream.loadgen.metrics import jain_index
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


def blocks(served: dict[str, float], requests: dict[str, int], ttft: dict[str, float],
           duration_s: float) -> dict[str, dict]:
    """Per-tenant summary blocks as report.summarize makes them (only the fields used)."""
    return {t: {"requests": requests[t], "input_tokens": served[t] * 0.75,
                "output_tokens": served[t] * 0.25, "total_tokens_per_s": served[t] / duration_s,
                "ttft_s": {"p50": ttft[t]}} for t in served}


def sent(tenant: str, n: int, prompt: int = 100, max_tokens: int = 30) -> list[dict]:
    return [{"tenant": tenant, "prompt_tokens": prompt, "max_tokens": max_tokens}] * n


HOT = sent("hot", 10) + sent("cold-1", 1) + sent("cold-2", 1) + sent("cold-3", 1)
"""The hot-tenant shape: hot sends 10 requests of 130 tokens, each cold tenant one."""
REQUESTS = {"hot": 10, "cold-1": 1, "cold-2": 1, "cold-3": 1}


def test_a_fair_server_reads_fair_under_a_hot_tenant():
    # served 1,040 tokens in 10 s: each cold tenant all it asked (130), hot the rest (650)
    served = {"hot": 650.0, "cold-1": 130.0, "cold-2": 130.0, "cold-3": 130.0}
    ttft = {"hot": 24.7, "cold-1": 3.2, "cold-2": 3.9, "cold-3": 3.5}
    figures = fairness(HOT, blocks(served, REQUESTS, ttft, 10.0), 10.0)
    assert figures["tenants"] == 4
    # the raw index misreads it: (650 + 390)^2 / (4 (650^2 + 3 130^2))
    assert figures["jain_index_raw_tokens"] == pytest.approx(1040 ** 2 / (4 * 473200))
    assert figures["jain_index_raw_tokens"] < 0.6
    # against demand it is fair: every tenant got exactly its max-min share
    assert figures["jain_index_fair_share"] == pytest.approx(1.0)
    assert figures["min_fair_share_ratio"] == pytest.approx(1.0)
    shares = figures["per_tenant"]
    assert shares["hot"]["demand_tokens_per_s"] == 130.0
    assert shares["cold-1"]["demand_tokens_per_s"] == 13.0
    assert shares["hot"]["fair_share_tokens_per_s"] == pytest.approx(65.0)
    assert shares["cold-2"]["fair_share_tokens_per_s"] == pytest.approx(13.0)
    assert shares["cold-3"]["achieved_tokens_per_s"] == 13.0 and shares["hot"]["ratio"] == \
        pytest.approx(1.0)


def test_first_come_first_served_reads_unfair_against_demand():
    # the same 1,040 tokens split in proportion to requests (10:1:1:1): cold tenants get 80 of
    # the 130 they asked while hot gets more than its share
    served = {"hot": 800.0, "cold-1": 80.0, "cold-2": 80.0, "cold-3": 80.0}
    ttft = {t: 10.0 for t in served}
    figures = fairness(HOT, blocks(served, REQUESTS, ttft, 10.0), 10.0)
    ratios = [800 / 650] + [80 / 130] * 3
    assert figures["jain_index_fair_share"] == pytest.approx(jain_index(ratios))
    assert figures["min_fair_share_ratio"] == pytest.approx(80 / 130)
    assert figures["per_tenant"]["cold-1"]["ratio"] == pytest.approx(80 / 130)


def test_tenants_that_sent_nothing_are_left_out_and_weights_apply():
    served = {"a": 60.0, "b": 30.0, "idle": 0.0}
    per_tenant = blocks(served, {"a": 1, "b": 1, "idle": 0}, {"a": 1.0, "b": 1.0, "idle": None},
                        1.0)
    samples = sent("a", 1, 50, 50) + sent("b", 1, 50, 50)  # both asked 100
    shares = tenant_shares(samples, per_tenant, 1.0, {"a": 2.0, "b": 1.0, "idle": 1.0})
    assert set(shares) == {"a", "b"}
    assert shares["a"] == TenantShare(100.0, 60.0, 60.0, 2.0)  # weight 2 of 90 served: 60
    assert shares["b"].ratio == pytest.approx(1.0)
    figures = fairness(samples, per_tenant, 1.0, {"a": 2.0, "b": 1.0, "idle": 1.0})
    assert figures["tenants"] == 2 and figures["jain_index_fair_share"] == pytest.approx(1.0)
    assert fairness(samples[:1], blocks({"a": 60.0}, {"a": 1}, {"a": 1.0}, 1.0), 1.0)[
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

    # a asks 205 tokens and b 204 in 4 s; 309 served: a got 205, b 104
    raw = [trace(0, "a", 0.0, [1.0, 1.5, 2.0], 2.0, 3), trace(1, "a", 1.0, [1.0, 2.0], 3.0, 2),
           trace(2, "b", 2.0, [0.5, 0.75, 1.0, 1.25], 1.5, 4),
           trace(3, "b", 3.0, [], 1.0, 0, status="error")]
    samples = [complete_sample(r) for r in raw]
    mix = {"classes": [{"name": "chat"}], "tenants": {"a": 1, "b": 1}}
    even = build_report(samples, {"mix": mix}, {}, {})["summary"]["fairness"]
    assert even["min_fair_share_ratio"] == pytest.approx(104 / 154.5)  # b short of half
    # with weight 3, a's share (3/4 of 309) covers all it asked: b's share is the other 104
    weighted = build_report(samples, {"mix": {**mix, "tenant_weights": {"a": 3.0, "b": 1.0}}},
                            {}, {})
    fairness = weighted["summary"]["fairness"]
    assert fairness["per_tenant"]["a"]["weight"] == 3.0
    assert fairness["per_tenant"]["b"]["fair_share_tokens_per_s"] == pytest.approx(104 / 4)
    assert fairness["jain_index_fair_share"] == pytest.approx(1.0)
    assert weighted["tenant"]["b"]["fair_share"]["ratio"] == pytest.approx(1.0)
