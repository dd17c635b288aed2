"""`tokstream chaos kill-rank 1` on the real SmolLM2 (the default server: --tp 3, its own free
port and admin key): a rank SIGKILLed while streams decode and a long prompt is mid-prefill;
every stream completes, nothing leaks, and the resumed greedy streams re-score on the argmax."""

import json
import subprocess
import sys

import psutil
import pytest

from helpers.chaos_report import resumed_after_fault
from helpers.serving import ROOT

pytestmark = [pytest.mark.startup, pytest.mark.slow, pytest.mark.timeout(600)]


def test_kill_rank_1_on_smollm2(tmp_path):
    path = tmp_path / "kill-rank.json"
    result = subprocess.run([sys.executable, "-m", "tokstream", "chaos", "kill-rank", "1",
                             "--max-tokens", "16", "--json", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=540)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    report = json.loads(path.read_text())
    assert report["ok"] and not any(report["violations"].values())
    assert report["server"]["model"] == "smollm2" and report["server"]["tp"] == 3
    fault, = report["faults"]
    assert fault["signal"] == "SIGKILL" and fault["target"] == "rank 1"
    states = [row["state_at_fault"] for row in fault["in_flight"]]
    assert any(s.startswith("prefilling") for s in states), states
    assert sum(s.startswith("decoding") for s in states) >= 2, states
    assert resumed_after_fault(report, fault)
    assert report["recovery_s"] > 0 and fault["server_recovery_s"]["rank"]
    content = report["content"]
    assert content["audited"] >= 2 and content["within_tolerance"] == content["audited"]
    assert report["classes"] == {"complete": len(report["streams"])}
    assert not psutil.pid_exists(report["target"]["pid"])
    assert "in flight at the fault" in output and "PASS" in output
