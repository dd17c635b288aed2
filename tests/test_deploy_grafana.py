"""deploy/grafana: every query the dashboard runs names series tokstream's /metrics exports,
is valid PromQL (promtool parses it), and the dashboard covers what an operator watches."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from helpers.metrics_series import exported_series, series_in
from helpers.serving import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "tokstream-dashboard.json"

# What the issue asks the dashboard to show, by the series that carry it.
MUST_SHOW = {
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "tokstream_tenant_tokens_total",
    "tokstream_restarts_total", "tokstream_recovery_seconds_bucket",
}


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def test_every_query_names_an_exported_series():
    exported = exported_series()
    for expr in queries():
        names = series_in(expr)
        assert names, f"a query reads no tokstream series: {expr}"
        missing = names - exported.keys()
        assert not missing, f"{expr} reads {missing}, which /metrics does not export"


def test_covers_what_an_operator_watches():
    used = set().union(*(series_in(expr) for expr in queries()))
    assert MUST_SHOW <= used, MUST_SHOW - used


def test_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_queries_are_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    # promtool parses a rule's expression: one recording rule per dashboard query.
    rules = [{"record": f"dashboard:query{i}", "expr": expr.replace("$model", ".*")}
             for i, expr in enumerate(queries()) if not expr.startswith("label_values(")]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
