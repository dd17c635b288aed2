"""The loadtest report's speculative decoding (issue 34 item 5): the server's spec_decode
counters read from /metrics before and after the run, their deltas and rates in report.json
and in the printed report; absent when the server does not speculate. The /metrics text is
tokstream's own (its Metrics class rendering a core snapshot), served by the fake server of
test_loadgen_plumbing."""

from __future__ import annotations

import json

import pytest

from helpers.loadtest_run import KEYS, loadtest
from test_loadgen_plumbing import FakeServer, write_mix_and_keys
from tokstream.loadgen.metrics import spec_decode_counters, speculation_over_run
from tokstream.loadgen.report import build_report
from tokstream.loadgen.tables import speculation_line
from tokstream.server.operations.metrics import Metrics


def exposition(speculation: dict) -> str:
    """tokstream's /metrics text for a core whose snapshot has this speculation section."""
    metrics = Metrics("toy")
    metrics.engine.snapshot = {"speculation": speculation}
    return metrics.render().decode()


def ngram(drafts: int, draft_tokens: int, accepted_per_position: list[int]) -> dict:
    return {"method": "ngram", "num_speculative_tokens": 3, "num_drafts": drafts,
            "num_draft_tokens": draft_tokens, "num_accepted_tokens": sum(accepted_per_position),
            "accepted_per_position": accepted_per_position}


def test_counters_parse_from_tokstreams_metrics_and_are_absent_elsewhere():
    counters = spec_decode_counters(exposition(ngram(7, 21, [3, 2])))
    assert counters == {"drafts": 7, "draft_tokens": 21, "accepted_tokens": 5,
                        "accepted_per_position": [3, 2]}
    assert spec_decode_counters(exposition({"method": "off"}))["draft_tokens"] == 0
    # A server that exposes no spec_decode counter at all (vLLM without speculation).
    assert spec_decode_counters('# TYPE vllm:num_requests_running gauge\n'
                                'vllm:num_requests_running{model_name="toy"} 2.0\n') is None


def test_the_run_counts_its_deltas_and_their_rates():
    before = spec_decode_counters(exposition(ngram(7, 21, [3, 2])))
    after = spec_decode_counters(exposition(ngram(47, 141, [43, 26, 8])))
    spec = speculation_over_run(before, after)
    # 40 drafts of 120 tokens; 40 + 24 + 8 = 72 accepted.
    assert spec == {"drafts": 40, "draft_tokens": 120, "accepted_tokens": 72,
                    "accepted_per_position": [40, 24, 8], "acceptance_rate": 0.6,
                    "mean_acceptance_length": 1 + 72 / 40,
                    "acceptance_per_position": [1.0, 0.6, 0.2], "counters_reset": False}
    assert speculation_line(spec) == (
        "speculation: 72 of 120 drafted tokens accepted (60.0%) in 40 drafts, mean acceptance "
        "length 2.80; by position 100.0% 60.0% 20.0%")
    # Nothing drafted during the run, though the server speculates: zeros, no rates.
    idle = speculation_over_run(after, after)
    assert idle["draft_tokens"] == 0 and idle["acceptance_rate"] is None
    assert "(-) in 0 drafts, mean acceptance length -" in speculation_line(idle)


def test_a_core_restarted_during_the_run_counts_from_its_restart():
    before = spec_decode_counters(exposition(ngram(47, 141, [43, 26, 8])))
    after = spec_decode_counters(exposition(ngram(10, 30, [9, 6])))
    spec = speculation_over_run(before, after)
    assert spec["counters_reset"] and spec["draft_tokens"] == 30 and \
        spec["accepted_per_position"] == [9, 6] and spec["acceptance_rate"] == 0.5
    assert speculation_line(spec).endswith("(the engine restarted during the run: counted "
                                           "since then)")


@pytest.mark.parametrize("before,after", [
    (None, None),
    ({"method": "off"}, {"method": "off"}),
], ids=["no-counters", "speculation-off"])
def test_no_speculation_no_block(before, after):
    read = [spec_decode_counters(exposition(s)) if s else None for s in (before, after)]
    assert speculation_over_run(*read) is None
    report = build_report([], {"mix": {"classes": [], "tenants": {}}}, {}, {},
                          speculation_over_run(*read))
    assert "speculation" not in report["summary"]


PER_REQUEST = (10, 30, [10, 6, 2])
"""What each request the fake serves adds: 10 drafts of 30 tokens, 18 accepted."""
BEFORE = (7, 21, [3, 2, 0])
"""What the server had counted before the run."""


@pytest.mark.startup
@pytest.mark.parametrize("speculating", [True, False], ids=["ngram", "off"])
def test_the_report_has_the_runs_speculation_only_when_the_server_speculates(tmp_path,
                                                                             speculating):
    mix, keys = write_mix_and_keys(tmp_path)
    out = tmp_path / "out"
    with FakeServer(context=1024, keys=KEYS) as fake:
        def metrics() -> str:
            if not speculating:
                return exposition({"method": "off"})
            served = len(fake.requests)
            drafts, tokens = (b + served * n for b, n in zip(BEFORE[:2], PER_REQUEST[:2]))
            return exposition(ngram(drafts, tokens, [b + served * n for b, n in
                                                     zip(BEFORE[2], PER_REQUEST[2])]))
        fake.metrics = metrics
        result = loadtest("--url", fake.url, "--mix", mix, "--keys", keys, "--requests", "16",
                          "--duration", "0", "--seed", "3", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "report.json").read_text())["summary"]
    assert summary["completed"] == 16
    if not speculating:
        assert "speculation" not in summary and "speculation:" not in result.stdout
        return
    # 16 requests: 160 drafts of 480 tokens, 288 accepted; the 7 drafts before are not the run's.
    spec = summary["speculation"]
    assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (160, 480, 288)
    assert spec["accepted_per_position"] == [160, 96, 32] and spec["acceptance_rate"] == 0.6
    assert ("speculation: 288 of 480 drafted tokens accepted (60.0%) in 160 drafts, mean "
            "acceptance length 2.80; by position 100.0% 60.0% 20.0%") in result.stdout
