"""The verdicts the benchmark scripts compute from their runs (no engine, no server): the
paired format check of bench/format_sweep.py and the per-case summary of
bench/one_request_cost.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import format_sweep  # noqa: E402
import one_request_cost  # noqa: E402


def sweep_runs(steps: dict[str, list[float]]) -> list[dict]:
    return [{"round": i, "weights": weights, "decode_step_ms": {1: ms}}
            for weights, per_round in steps.items() for i, ms in enumerate(per_round)]


def test_the_format_check_pairs_each_round():
    # the machine slows from round to round; the default is 5% slower than native in each
    runs = sweep_runs({"auto": [10.5, 21.0, 42.0], "native": [10.0, 20.0, 40.0]})
    assert format_sweep.paired_ratio(runs, "auto", "native", 1) == pytest.approx(1.05)
    # 10% slower in two rounds of three, though a disturbance gave it the lower median
    runs = sweep_runs({"auto": [11.0, 19.0, 44.0], "native": [10.0, 20.0, 40.0]})
    assert format_sweep.paired_ratio(runs, "auto", "native", 1) == pytest.approx(1.1)


def gap_runs(*worst: float) -> list[dict]:
    return [{"worst_gap_ms": w, "p99_gap_ms": w / 2, "health_max_ms": 5.0,
             "hostile_status": 200, "hostile_s": 1.0} for w in worst]


def test_each_case_is_set_against_the_baseline_and_its_control():
    baselines = gap_runs(20.0, 30.0, 25.0)
    runs = {"control_plain": gap_runs(60.0, 50.0, 70.0),
            "json_deep_50": gap_runs(90.0, 10.0, 30.0),
            "count_tokens_special_6k": gap_runs(50.0)}
    out = one_request_cost.summary(runs, baselines)
    assert out["baseline"]["worst_gap_ms"] == 25.0
    deep = out["json_deep_50"]
    assert deep["worst_gap_ms"] == 30.0 and deep["worst_gap_each_ms"] == [90.0, 10.0, 30.0]
    assert deep["ratio_to_baseline"] == 1.2
    assert deep["control"] == "control_plain" and deep["ratio_to_control"] == 0.5
    assert "ratio_to_control" not in out["count_tokens_special_6k"]  # it has no control
    # a control that did not run this time gives no ratio (penalties_long_prompt's)
    alone = one_request_cost.summary({"penalties_long_prompt": gap_runs(40.0)}, baselines)
    assert "ratio_to_control" not in alone["penalties_long_prompt"]


def test_every_run_has_prompts_of_its_own():
    first = one_request_cost.hostile_cases("m", 512, tag="round 0")
    second = one_request_cost.hostile_cases("m", 512, tag="round 1")
    for name in first:
        a = first[name]["body"]["messages"][0]["content"]
        b = second[name]["body"]["messages"][0]["content"]
        assert a != b and a.startswith(f"[{name} round 0]")
    # the long prompt and its control share no first block
    assert first["long_prompt_plain"]["body"]["messages"][0]["content"][:16] \
        != first["penalties_long_prompt"]["body"]["messages"][0]["content"][:16]
