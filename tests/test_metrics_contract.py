"""/metrics honours the model-server protocol of the Gateway API Inference Extension (what its
endpoint picker scrapes to route) and the vLLM names dashboards read: parsed with
prometheus_client's own parser from a real `tokstream serve`, names, types and labels."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.metrics_series import exported_series
from helpers.serving import ServerProcess

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

# family name (as the parser reports it: counters without _total) -> (type, labels it must carry)
CONTRACT = {
    # The extension's model-server protocol: queue, running, KV utilisation, pool geometry.
    "vllm:num_requests_waiting": ("gauge", {"model_name"}),
    "vllm:num_requests_running": ("gauge", {"model_name"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:cache_config_info": ("gauge", {"model_name", "block_size", "num_gpu_blocks"}),
    # The vLLM series users' dashboards read.
    "vllm:prefix_cache_queries": ("counter", {"model_name"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name"}),
    "vllm:num_preemptions": ("counter", {"model_name"}),
    "vllm:prompt_tokens": ("counter", {"model_name"}),
    "vllm:generation_tokens": ("counter", {"model_name"}),
    "vllm:request_success": ("counter", {"model_name", "finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_prompt_tokens": ("histogram", {"model_name"}),
    "vllm:request_generation_tokens": ("histogram", {"model_name"}),
    "vllm:request_prefill_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_decode_time_seconds": ("histogram", {"model_name"}),
    # tokstream's own.
    "tokstream_replica_status": ("gauge", {"model_name", "status"}),
    "tokstream_restarts": ("counter", {"kind"}),
    "tokstream_recovery_seconds": ("histogram", {"kind"}),
    "tokstream_kv_blocks": ("gauge", {"model_name", "state"}),
}

# Long enough for several full 16-token blocks, so the second request hits the prefix cache.
PROMPT = "the quick brown fox jumps over the lazy dog " * 12
NUM_REQUESTS = 3


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    sample = sample or name
    return sum(s.value for s in families[name].samples
               if s.name == sample and labels.items() <= s.labels.items())


@pytest.fixture(scope="module")
def scrapes():
    """/metrics before and after a few identical completions on dummy:tiny."""
    with ServerProcess("--model", "dummy:tiny") as server:
        before = scrape(server.url)
        for _ in range(NUM_REQUESTS):
            response = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "dummy:tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
            assert response.status_code == 200, response.text + "".join(server.log[-30:])
        yield before, scrape(server.url)


def test_names_types_and_labels(scrapes):
    _, families = scrapes
    for name, (kind, labels) in CONTRACT.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, f"{name} is a {families[name].type}, not {kind}"
        for sample in families[name].samples:
            assert labels <= sample.labels.keys(), f"{sample.name} lacks {labels}"


def test_cache_config_info_names_the_pool(scrapes):
    _, families = scrapes
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.value == 1
    assert int(sample.labels["block_size"]) > 0
    assert int(sample.labels["num_gpu_blocks"]) > 0
    assert int(sample.labels["num_gpu_blocks"]) == value(families, "tokstream_kv_blocks_total")


def test_counts_follow_requests(scrapes):
    before, after = scrapes
    assert value(after, "vllm:request_success", "vllm:request_success_total") == NUM_REQUESTS
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert value(after, name, name + "_count") == NUM_REQUESTS, name
    assert value(after, "vllm:request_generation_tokens",
                 "vllm:request_generation_tokens_sum") == 6 * NUM_REQUESTS
    prompt_sum = value(after, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum")
    assert prompt_sum == value(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total")


def test_prefix_cache_counted_for_real(scrapes):
    before, after = scrapes
    queries = value(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    hits = value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert value(before, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 0
    assert queries > 0
    # The second and third requests repeat the first's prompt: its full blocks are cached.
    assert 0 < hits < queries


def test_every_contract_series_is_in_the_registry_list():
    """The list the dashboard and rule tests check against covers the live contract."""
    series = exported_series()
    for name, (kind, _) in CONTRACT.items():
        sample = {"counter": name + "_total", "histogram": name + "_bucket"}.get(kind, name)
        assert sample in series, sample
