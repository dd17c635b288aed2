"""The series a tokstream /metrics page can export, read from the metrics registry itself, so
the dashboard and rule tests check against the code rather than a list typed twice."""

from __future__ import annotations

import re

from tokstream.server.operations.metrics import Metrics

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum",
                                                              "_created"),
            "gauge": ("",), "info": ("_info",)}


def exported_series() -> dict[str, set[str]]:
    """Sample name -> its label names (without `le`), for every series /metrics can show."""
    metrics = Metrics("m")
    # A snapshot with the pool's geometry, as the core sends it, so the info series appears.
    metrics.engine.snapshot = {"kv": {"block_size": 16, "num_blocks": 8}}
    metrics.tenant_tokens.labels("t", "prompt")
    metrics.errors.labels("api_error")
    metrics.cancels.labels("disconnect")
    metrics.success.labels("m", "stop")
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        labels = {name for sample in family.samples for name in sample.labels} - {"le"}
        for suffix in SUFFIXES.get(family.type, ("",)):
            series[family.name + suffix] = labels
    return series


# vLLM's names and tokstream's raw series; `tokstream:` (colons) are our recording rules.
SERIES_NAME = re.compile(r"\b(vllm:[A-Za-z0-9_]+|tokstream_[A-Za-z0-9_]+|tokstream:[A-Za-z0-9_:]+)")


def series_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label values in quotes excluded)."""
    return set(SERIES_NAME.findall(re.sub(r'"[^"]*"', '""', expr)))
