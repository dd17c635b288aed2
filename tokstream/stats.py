"""The summary statistics every report shares (bench, loadtest, chaos, bench/ scripts): one
percentile and one Jain's index, pure Python, no torch."""

from __future__ import annotations

import math

SUMMARY_PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) by linear interpolation between closest ranks, as
    numpy.percentile's default (and vllm bench serve) computes it; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """{"p50", "p90", "p99", "mean"} of values (each None when there are none)."""
    out = {f"p{q}": percentile(values, q) for q in SUMMARY_PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index of non-negative values, (sum x)^2 / (n * sum x^2): 1 is perfectly
    even, 1/n is one value taking everything; None when there is nothing to compare."""
    if not values:
        return None
    total = sum(values)
    squares = sum(v * v for v in values)
    if squares == 0:
        return None
    return total * total / (len(values) * squares)
