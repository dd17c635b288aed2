"""The load test's metric math on synthetic timestamp traces, with exact expected values."""

import math
import random

import pytest

from tokstream.loadgen.metrics import distribution, meets_slo, parse_slo, request_timings, summarize
from tokstream.stats import jain_index, percentile, percentiles


def test_percentile_interpolates_between_closest_ranks():
    values = [10.0, 1.0, 4.0, 2.0, 3.0]  # unsorted on purpose
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    # rank (5 - 1) * 0.9 = 3.6: 4 + 0.6 * (10 - 4)
    assert percentile(values, 90) == pytest.approx(7.6, abs=1e-12)
    assert percentile(values, 99) == pytest.approx(4 + 0.96 * 6, abs=1e-12)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    # The bench reports' shape, from the same function.
    assert percentiles(values) == {"p50": 3.0, "p90": percentile(values, 90),
                                   "p99": percentile(values, 99), "mean": 4.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    # 1..100: p50 = 50.5, p90 = 90.1, p99 = 99.01
    hundred = [float(n) for n in range(1, 101)]
    random.Random(3).shuffle(hundred)
    d = distribution(hundred)
    assert (d["p50"], d["n"], d["max"], d["mean"]) == (50.5, 100, 100.0, 50.5)
    assert d["p90"] == pytest.approx(90.1, abs=1e-9) and d["p99"] == pytest.approx(99.01, abs=1e-9)


def test_request_timings_from_an_event_trace():
    # sent at t=10; events at 10.5 (1 token), 10.7 (1), 11.2 (2 tokens merged), end 11.3
    t = request_timings(10.0, [10.5, 10.7, 11.2], [1, 1, 2], 11.3)
    assert t["ttft_s"] == pytest.approx(0.5)
    assert t["itl_s"] == pytest.approx([0.2, 0.5])
    assert t["e2e_s"] == pytest.approx(1.3)
    assert t["tpot_s"] == pytest.approx((1.3 - 0.5) / 3)  # 4 tokens: 3 after the first
    one = request_timings(0.0, [0.25], [1], 0.3)
    assert one["tpot_s"] is None and one["itl_s"] == []
    none = request_timings(0.0, [], [], 2.0)
    assert none["ttft_s"] is None and none["e2e_s"] == 2.0


def sample(status="ok", ttft=0.5, gaps=(0.1, 0.1), tpot=0.1, e2e=1.0, out=3, inp=10, **extra):
    return {"status": status, "ttft_s": ttft, "itl_s": list(gaps), "tpot_s": tpot, "e2e_s": e2e,
            "output_tokens": out, "input_tokens": inp, "error_type": extra.get("error_type")}


def test_goodput_counts_requests_meeting_every_objective():
    slo = parse_slo("ttft=1,itl=200ms")
    assert slo == {"ttft": 1.0, "itl": 0.2}
    samples = [
        sample(),                                  # meets both
        sample(ttft=1.5),                          # TTFT too slow
        sample(gaps=(0.1, 0.25, 0.1)),             # one stall past the ITL objective
        sample(ttft=1.0, gaps=(0.2,)),             # exactly at both limits: meets
        sample(status="error", error_type="overloaded_error", ttft=None, gaps=(), tpot=None,
               out=None, inp=None),
    ]
    assert [meets_slo(s, slo) for s in samples] == [True, False, False, True, False]
    block = summarize(samples, duration_s=4.0, slo=slo)
    assert block["goodput"] == {"requests_per_s": 0.5, "requests": 2, "fraction": 0.4,
                                "slo": slo}
    assert (block["completed"], block["failed"], block["errors"]) == \
        (4, 1, {"overloaded_error": 1})
    assert block["output_tokens"] == 12 and block["output_tokens_per_s"] == 3.0
    assert block["total_tokens_per_s"] == (12 + 40) / 4
    # ITL pools every gap of every completed request: 2 + 2 + 3 + 1 gaps
    assert block["itl_s"]["n"] == 8
    assert block["ttft_s"]["p50"] == pytest.approx(0.75)  # [0.5, 0.5, 1.0, 1.5]
    no_slo = summarize(samples, 4.0, {})
    assert no_slo["goodput"]["requests"] == 4  # every completed request counts


@pytest.mark.parametrize("text,message", [
    ("ttft", "KEY=SECONDS"), ("latency=1", "KEY=SECONDS"), ("ttft=abc", "not a number"),
    ("itl=0", "positive"), ("itl=-1", "positive"), ("ttft=inf", "positive"),
])
def test_bad_slo_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def test_jain_index():
    assert jain_index([5.0, 5.0, 5.0, 5.0]) == 1.0
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == 0.25  # one takes all: 1/n
    # (1+2+3+4)^2 / (4 * 30) = 100/120
    assert jain_index([1.0, 2.0, 3.0, 4.0]) == pytest.approx(100 / 120, abs=1e-15)
    # the hot-tenant shape: 10, 1, 1, 1 -> 169 / (4 * 103)
    assert jain_index([10.0, 1.0, 1.0, 1.0]) == pytest.approx(169 / 412, abs=1e-15)
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None
    assert math.isclose(jain_index([3.0] * 7), 1.0)


def trace(index, tenant, start, events, end, out, inp=100, workload="chat", status="ok",
          max_tokens=None):
    """A raw sample as the Locust process writes it: event times relative to the send."""
    return {"index": index, "workload": workload, "tenant": tenant, "status": status,
            "max_tokens": out if max_tokens is None else max_tokens,
            "error_type": None if status == "ok" else "overloaded_error", "start_s": start,
            "scheduled_s": None, "event_times_s": events, "event_tokens": [1] * len(events),
            "end_s": end, "input_tokens": inp if status == "ok" else None,
            "output_tokens": out if status == "ok" else None, "prompt_tokens": inp,
            "clamped": False, "raised": False, "integrity": [], "http_status": 200}


def test_report_blocks_from_synthetic_traces():
    from tokstream.loadgen.report import build_report, complete_sample

    raw = [trace(0, "a", 0.0, [1.0, 1.5, 2.0], 2.0, 3),          # ends at 2
           trace(1, "a", 1.0, [1.0, 2.0], 3.0, 2),                # ends at 4
           trace(2, "b", 2.0, [0.5, 0.75, 1.0, 1.25], 1.5, 4),    # ends at 3.5
           trace(3, "b", 3.0, [], 1.0, 0, status="error")]        # ends at 4
    samples = [complete_sample(r) for r in raw]
    assert samples[0]["itl_s"] == [0.5, 0.5] and samples[0]["ttft_s"] == 1.0
    assert samples[2]["tpot_s"] == pytest.approx((1.5 - 0.5) / 3)
    mix = {"classes": [{"name": "chat"}, {"name": "idle"}], "tenants": {"a": 1, "b": 1, "c": 1}}
    report = build_report(samples, {"mix": mix}, {"ttft": 0.9}, {})
    summary = report["summary"]
    assert summary["duration_s"] == 4.0  # first send at 0, last end at 4
    assert (summary["requests"], summary["completed"], summary["failed"]) == (4, 3, 1)
    assert summary["output_tokens_per_s"] == 9 / 4 and summary["total_tokens_per_s"] == 309 / 4
    assert summary["ttft_s"]["p50"] == 1.0 and summary["itl_s"]["n"] == 2 + 1 + 3
    assert summary["goodput"]["requests"] == 1  # only b's first request had TTFT <= 0.9
    # every tenant and class of the mix has a block, the silent ones included
    assert set(report["tenant"]) == {"a", "b", "c"} and report["tenant"]["c"]["requests"] == 0
    assert set(report["class"]) == {"chat", "idle"} and report["class"]["idle"]["requests"] == 0
    a, b = report["tenant"]["a"], report["tenant"]["b"]
    assert (a["input_tokens"] + a["output_tokens"], b["input_tokens"] + b["output_tokens"]) == \
        (205, 104)
    assert a["share_of_tokens"] == pytest.approx(205 / 309)
    assert a["share_of_requests"] == 0.5
    # raw Jain over the tenants that sent requests: tokens/s 205/4 and 104/4
    fairness = summary["fairness"]
    assert fairness["tenants"] == 2
    assert fairness["jain_index_raw_tokens"] == pytest.approx(
        (205 + 104) ** 2 / (2 * (205 ** 2 + 104 ** 2)))
    assert fairness["jain_index_ttft"] == pytest.approx(jain_index([1 / 1.0, 1 / 0.5]))
    # against demand, from the first send (0) to the last (3): a asked 100+3 + 100+2 = 205
    # tokens and was served all of them by t = 3; b asked 100+4 + 100+0 = 204 (its failed
    # request's max_tokens is 0 here) and was served 100 + 3 (its 4th token came at 3.25).
    # Both ask more than half of the 308 served: each one's fair share is 154
    shares = fairness["per_tenant"]
    assert fairness["window_s"] == [0.0, 3.0]
    assert shares["a"]["demand_tokens_per_s"] == 205 / 3 and shares["b"]["demand_tokens_per_s"] \
        == 204 / 3
    assert shares["b"]["achieved_tokens_per_s"] == 103 / 3
    assert shares["a"]["fair_share_tokens_per_s"] == shares["b"]["fair_share_tokens_per_s"] \
        == pytest.approx(154 / 3)
    assert shares["b"]["ratio"] == pytest.approx(103 / 154)
    assert fairness["jain_index_fair_share"] == pytest.approx(jain_index([205 / 154, 103 / 154]))
    assert fairness["min_fair_share_ratio"] == pytest.approx(103 / 154)
    assert report["tenant"]["a"]["fair_share"] == shares["a"] and "c" not in shares
