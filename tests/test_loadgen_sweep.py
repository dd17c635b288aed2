"""The capacity sweep: stage planning (pure), and a whole sweep against the fake SSE server of
the plumbing tests, its report's sweep block, capacity.json and sweep.png. No wall-clock
asserts: the stages' rates are checked against what the sweep itself measured."""

import json
import random

import pytest

from helpers.loadtest_run import KEYS, SHORT, TENANTS, flood, loadtest, write_mix
from test_loadgen_plumbing import FakeServer
from tokstream.errors import UserInputError
from tokstream.loadgen.capacity import read_capacity
from tokstream.loadgen.mix import load_mix
from tokstream.loadgen.runner import Options
from tokstream.loadgen.sweep import (STAGE_S, Stage, SweepBounds, closed_stages,
                                     constant_stages, plan_rates, sweep_verdict)


def test_rates_are_evenly_spaced_above_the_synchronous_rate_up_to_capacity():
    assert plan_rates(2.0, 10.0, 4) == [4.0, 6.0, 8.0, 10.0]
    assert plan_rates(1.0, 3.0, 1) == [3.0]
    rng = random.Random(5)
    for _ in range(200):
        sync = rng.uniform(0.01, 50)
        capacity = sync * rng.uniform(1.001, 100)
        count = rng.randint(1, 12)
        rates = plan_rates(sync, capacity, count)
        assert len(rates) == count
        assert all(a < b for a, b in zip(rates, rates[1:]))  # strictly increasing
        assert sync < rates[0] and rates[-1] == capacity  # above sync, bounded by capacity
        gaps = [b - a for a, b in zip([sync] + rates, rates)]
        assert max(gaps) == pytest.approx(min(gaps))  # evenly spaced


def test_no_capacity_above_the_synchronous_rate_leaves_one_stage():
    assert plan_rates(5.0, 5.0, 4) == [5.0]
    assert plan_rates(5.0, 3.0, 4) == [5.0]  # noise: concurrency measured slower
    with pytest.raises(ValueError, match="count"):
        plan_rates(1.0, 2.0, 0)
    with pytest.raises(ValueError, match="synchronous"):
        plan_rates(0.0, 2.0, 3)


def options(**overrides):
    return Options(url="http://127.0.0.1:9", mix="chat", sweep=True, **overrides)


def test_stage_bounds_and_settings():
    mix = load_mix("chat")
    bounds = SweepBounds.from_options(options(), mix)
    assert (bounds.duration_s, bounds.requests, bounds.rates) == (STAGE_S, 0, 5)
    assert (bounds.throughput_users, bounds.open_users) == (32, 64)
    bounds = SweepBounds.from_options(options(duration="5s", requests=40, sweep_rates=3,
                                              throughput_users=50), mix)
    assert (bounds.duration_s, bounds.requests, bounds.open_users) == (5.0, 40, 100)
    sync, throughput = closed_stages(bounds)
    assert sync.settings() == {"arrival": "closed", "users": 1, "rate": None,
                               "capacity_fraction": None, "burstiness": 1.0, "duration_s": 5.0,
                               "requests": 40}
    assert (throughput.kind, throughput.users, throughput.arrival) == ("throughput", 50,
                                                                       "closed")
    stages = constant_stages(bounds, [1.5, 3.0])
    assert [(s.arrival, s.rate, s.users, s.duration_s, s.requests) for s in stages] == \
        [("poisson", 1.5, 100, 5.0, 40), ("poisson", 3.0, 100, 5.0, 40)]
    assert [s.name(n) for n, s in enumerate([sync, throughput, *stages], 1)] == \
        ["01-synchronous", "02-throughput", "03-constant-1.5", "04-constant-3"]
    with pytest.raises(UserInputError, match="no bound"):
        SweepBounds.from_options(options(duration="0", requests=0), mix)
    with pytest.raises(ValueError, match="rate"):
        Stage("constant", 8, None, 5.0, 0)
    with pytest.raises(ValueError, match="rate"):
        Stage("synchronous", 1, 2.0, 5.0, 0)


@pytest.mark.parametrize("flags,message", [
    ({"rate": 2.0}, "--rate"), ({"arrival": "poisson"}, "--arrival"),
    ({"capacity_fraction": 0.5}, "--capacity-fraction"), ({"capacity": "3"}, "--capacity"),
    ({"sweep_rates": 0}, "--sweep-rates"), ({"sweep_rates": 99}, "--sweep-rates"),
])
def test_a_sweep_refuses_flags_that_set_its_rates(flags, message):
    with pytest.raises(UserInputError, match=message):
        options(**flags)


def row(kind, sent=10, completed=10, failed=0, cancelled=0, broken=0, mismatched=0):
    return {"kind": kind, "sent": sent, "completed": completed, "failed": failed,
            "cancelled": cancelled, "integrity_failed": broken,
            "prompt_tokens_mismatched": mismatched}


def test_overload_at_the_top_rates_is_data_broken_streams_are_failures():
    opts = options()
    overloaded = [row("synchronous"), row("throughput"), row("constant", completed=4,
                                                             failed=2, cancelled=4)]
    assert sweep_verdict(overloaded, opts) == []
    assert "synchronous" in sweep_verdict([row("synchronous", completed=8, failed=2)], opts)[0]
    assert "integrity" in sweep_verdict([row("synchronous"), row("constant", broken=1)],
                                        opts)[0]
    assert "length" in sweep_verdict([row("throughput", mismatched=2)], opts)[0]


def write_sweep_mix(tmp_path, tenants=None):
    return write_mix(tmp_path, {"users": 3}, [SHORT, flood(200, 0.2)], tenants)


@pytest.mark.startup
def test_sweep_runs_every_stage_and_reports_rates_latency_and_throughput(tmp_path):
    mix, keys = write_sweep_mix(tmp_path, TENANTS)
    out = tmp_path / "out"
    with FakeServer(context=1024, keys=KEYS, token_delay_s=0.01) as fake:
        result = loadtest("--url", fake.url, "--mix", mix, "--keys", keys, "--sweep",
                          "--sweep-rates", "2", "--duration", "20s", "--requests", "6",
                          "--throughput-users", "3", "--drain-timeout", "30", "--out", str(out),
                          timeout=240)
        served = list(fake.requests)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "sweep" and report["verdict"] == {"ok": True, "reasons": []}
    sweep = report["sweep"]
    stages = sweep["stages"]
    assert [s["kind"] for s in stages] == ["synchronous", "throughput", "constant", "constant"]
    assert [s["users"] for s in stages[:2]] == [1, 3]
    # the rates are planned from what the first two stages measured
    sync_rate = stages[0]["achieved_requests_per_s"]
    capacity = stages[1]["achieved_requests_per_s"]
    assert sweep["synchronous_requests_per_s"] == sync_rate
    assert sweep["capacity"]["requests_per_s"] == capacity and sweep["capacity"]["users"] == 3
    assert sweep["rates"] == plan_rates(sync_rate, capacity, 2)
    assert [s["offered_requests_per_s"] for s in stages] == [None, None, *sweep["rates"]]
    assert [s["arrival"] for s in stages] == ["closed", "closed", "poisson", "poisson"]
    for stage in stages:
        assert stage["sent"] == 6 == stage["completed"]  # each bounded by --requests
        assert stage["failed"] == stage["cancelled"] == 0
        assert stage["achieved_requests_per_s"] == pytest.approx(6 / stage["span_s"])
        assert stage["output_tokens_per_s"] > 0
        for key in ("ttft_s", "itl_s"):
            assert set(stage[key]) == {"p50", "p90", "p99"}
            assert 0 < stage[key]["p50"] <= stage[key]["p90"] <= stage[key]["p99"]
        # each stage's full report sits in its own directory
        stage_report = json.loads((out / stage["report"]).read_text())
        assert stage_report["summary"]["requests"] == 6
        assert stage_report["config"]["settings"]["rate"] == stage["offered_requests_per_s"]
    # the bursts are left out: a sweep's rate is the main arrivals'
    assert sweep["bursts_left_out"] is True
    assert len(served) == 4 * 6 and all(r["prompt_tokens"] <= 60 for r in served)
    # capacity.json is reusable as --capacity
    reread = read_capacity(str(out / "capacity.json"), "mix")
    assert reread.requests_per_s == capacity and reread.mix == "mix"
    assert read_capacity(str(out / "report.json"), "mix").requests_per_s == capacity
    import matplotlib.image

    assert matplotlib.image.imread(out / "sweep.png").shape[0] > 400
    assert "Sweep of mix mix" in result.stdout and "04-constant" in result.stdout
    assert "sweep stage 4/4" in result.stderr
    # the PNG redraws from report.json alone
    from tokstream.loadgen.plots import plot_sweep

    again = plot_sweep(report, tmp_path)
    assert again.stat().st_size > 20000


@pytest.mark.startup
def test_a_sweep_against_a_failing_server_stops_after_the_synchronous_stage(tmp_path):
    mix, _ = write_sweep_mix(tmp_path)
    out = tmp_path / "out"
    with FakeServer(context=1024) as fake:
        fake.fault = lambda n: "529"
        result = loadtest("--url", fake.url, "--mix", mix, "--sweep", "--requests", "3",
                          "--duration", "0", "--out", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    assert [s["kind"] for s in report["sweep"]["stages"]] == ["synchronous"]
    reasons = report["verdict"]["reasons"]
    assert any("completed no request" in r for r in reasons)
    assert any("synchronous stage" in r and "lost 3 of 3" in r for r in reasons)
    assert report["sweep"]["capacity"] is None and not (out / "capacity.json").exists()
    assert (out / "sweep.png").stat().st_size > 5000  # drawn with what there is
