"""A short real `tokstream loadtest` against `tokstream serve` on the real SmolLM2, with tenants."""

import json
import subprocess
import sys

import pytest

from helpers.serving import ROOT, ServerProcess

pytestmark = pytest.mark.startup  # starts servers or engines (make test-fast leaves it out)

MIX = """
kind = "mix"
[tenants]
hot = 1
cold-1 = 1
[[class]]
name = "chat"
prompt_tokens = [50, 150]
output_tokens = [2, 6]
"""


@pytest.mark.slow
def test_short_real_run_on_smollm2_with_tenant_keys(tmp_path):
    (tmp_path / "mix.toml").write_text(MIX)
    out = tmp_path / "out"
    with ServerProcess("--model", "smollm2", "--kv-cache-memory", "256MiB",
                       "--tenants", str(ROOT / "profiles/tenants/demo.toml")) as server:
        result = subprocess.run(
            [sys.executable, "-m", "tokstream", "loadtest", "--url", server.url,
             "--mix", str(tmp_path / "mix.toml"), "--keys",
             str(ROOT / "profiles/tenants/demo-keys.toml"), "--users", "2", "--requests", "2",
             "--duration", "0", "--seed", "1", "--out", str(out)],
            capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
        tenants = {t["name"]: t for t in server.state(**{"x-api-key": "sk-demo-admin"})["tenants"]}
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert (summary["requests"], summary["completed"], summary["failed"]) == (2, 2, 0)
    assert summary["integrity"] == {"streams_checked": 2, "streams_failed": 0, "problems": {}}
    samples = report["samples"]
    # exact lengths in SmolLM2's own tokenizer, and exactly the output asked for (ignore_eos)
    assert all(s["input_tokens"] == s["prompt_tokens"] for s in samples)
    assert all(s["output_tokens"] == s["max_tokens"] for s in samples)
    # a gap between token-carrying events; an event may carry several tokens (accepted
    # drafts under --speculative auto, or a client that lagged), never none
    assert all(1 <= len(s["itl_s"]) + 1 <= s["output_tokens"] for s in samples)
    assert all(s["ttft_s"] > 0 and s["e2e_s"] >= s["ttft_s"] for s in samples)
    # every request reached the server under its own tenant's key: the server's per-tenant
    # token counts are the report's
    for name, block in report["tenant"].items():
        assert tenants[name]["prompt_tokens"] == block["input_tokens"]
        assert tenants[name]["output_tokens"] == block["output_tokens"]
    fairness = report["summary"]["fairness"]
    assert len(report["tenant"]) == 2 and fairness["jain_index_raw_tokens"] > 0
    assert set(fairness["per_tenant"]) == {"hot", "cold-1"}
