"""deploy/prometheus: the rules pass promtool's checks and unit tests, read only series tokstream
exports, and a real Prometheus scrapes a running `tokstream serve` and sees its rates move.

promtool and prometheus come from Debian's `prometheus` package (.ci/run installs it); without
them these tests skip, naming the missing binary."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from helpers.metrics_series import exported_series, series_in
from helpers.serving import ROOT, ServerProcess, die_with_parent

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "tokstream-rules.yml"

pytestmark = pytest.mark.timeout(90)


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} not installed (Debian package `prometheus`)")
    return path


def promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> None:
    result = subprocess.run([need("promtool"), *args], cwd=cwd, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_check():
    promtool("check", "rules", RULES.name)


def test_rules_unit_tests():
    promtool("test", "rules", "tokstream-rules.test.yml")


def test_config_check():
    promtool("check", "config", "prometheus.yml")


def test_rules_read_only_exported_series():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    recorded = {rule["record"] for rule in rules if "record" in rule}
    exported = exported_series()
    for rule in rules:
        for name in series_in(rule["expr"]):
            assert name in exported or name in recorded, (
                f"{rule.get('record') or rule['alert']} reads {name}, which /metrics lacks")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def query(api: str, promql: str) -> list[dict]:
    response = httpx.get(api + "/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(api: str, promql: str) -> float:
    result = query(api, promql)
    return float(result[0]["value"][1]) if result else 0.0


def wait_for(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus never saw {what} within {seconds} s")
        time.sleep(0.5)


@pytest.mark.startup
def test_live_prometheus_scrapes_a_server(tmp_path):
    prometheus = need("prometheus")
    with ServerProcess("--model", "dummy:tiny") as server:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "tokstream", "static_configs": [
                {"targets": [server.url.removeprefix("http://")]}]}],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        address = f"127.0.0.1:{free_port()}"
        process = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={address}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=die_with_parent)
        api = f"http://{address}"
        try:
            def ready() -> bool:
                # Prometheus answers 503 "Service Unavailable" (not JSON) until its TSDB is open.
                try:
                    return httpx.get(api + "/-/ready", timeout=5).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(ready, "itself ready", seconds=60)
            wait_for(lambda: scalar(api, 'up{job="tokstream"}') == 1, "the tokstream target up")
            assert scalar(api, 'tokstream_replica_status{status="ready"}') == 1
            rate = 'sum(rate(vllm:generation_tokens_total[10s]))'
            assert scalar(api, rate) == 0
            for _ in range(4):
                response = httpx.post(server.url + "/v1/completions", timeout=30, json={
                    "model": "dummy:tiny", "prompt": "hello there", "max_tokens": 8})
                assert response.status_code == 200, response.text
            wait_for(lambda: scalar(api, rate) > 0, "the generation token rate move")
            wait_for(lambda: scalar(api, "sum(tokstream:generation_tokens:rate1m)") > 0,
                     "the shipped recording rule produce a rate")
            rules = httpx.get(api + "/api/v1/rules", timeout=5).json()["data"]["groups"]
            unhealthy = [rule["name"] for group in rules for rule in group["rules"]
                         if rule["health"] not in ("ok", "unknown")]
            assert not unhealthy, unhealthy
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
