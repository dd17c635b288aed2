"""The metric math of a load test, pure: percentiles, per-request timings, goodput, Jain's index.

Definitions (vllm bench serve's, so numbers compare):
- TTFT: request sent -> first token-carrying event.
- ITL: every gap between consecutive token-carrying events of one request.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request with at least 2 output tokens.
- Goodput: requests per second that completed and met every SLO given. The ITL objective holds
  for a request when its worst gap is within it: a reader sees the longest stall, not the mean.
- Jain's index over per-tenant throughput x: (sum x)^2 / (n * sum x^2); 1 is perfectly even,
  1/n is one tenant taking everything.
"""

from __future__ import annotations

import math

from tokstream.stats import percentile

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


def distribution(values: list[float]) -> dict:
    """{"p50", "p90", "p99", "mean", "max", "n"} of values (None entries when empty)."""
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["max"] = max(values) if values else None
    out["n"] = len(values)
    return out


def request_timings(sent_s: float, event_times_s: list[float], event_tokens: list[int],
                    end_s: float) -> dict:
    """TTFT, ITL gaps, TPOT and end-to-end of one stream from its token-carrying events'
    arrival times (each event may carry several tokens when the client lagged)."""
    output_tokens = sum(event_tokens)
    ttft = event_times_s[0] - sent_s if event_times_s else None
    gaps = [b - a for a, b in zip(event_times_s, event_times_s[1:])]
    e2e = end_s - sent_s
    tpot = (e2e - ttft) / (output_tokens - 1) if ttft is not None and output_tokens > 1 else None
    return {"ttft_s": ttft, "itl_s": gaps, "tpot_s": tpot, "e2e_s": e2e}


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=2,itl=0.2' (seconds; a trailing 'ms' or 's' is understood) -> {"ttft": 2.0, ...}."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: {part!r} is not KEY=SECONDS with KEY one of "
                             f"{', '.join(SLO_KEYS)}")
        value = value.strip().lower()
        scale = 1.0
        if value.endswith("ms"):
            value, scale = value[:-2], 1e-3
        elif value.endswith("s"):
            value = value[:-1]
        try:
            seconds = float(value) * scale
        except ValueError:
            raise ValueError(f"--slo: {part!r}: {value!r} is not a number") from None
        if not seconds > 0 or math.isinf(seconds):
            raise ValueError(f"--slo: {part!r} must be a positive number of seconds")
        slo[key] = seconds
    return slo


def meets_slo(sample: dict, slo: dict[str, float]) -> bool:
    """A completed request meets the SLO when each objective given holds for it."""
    if sample["status"] != "ok":
        return False
    worst_gap = max(sample["itl_s"], default=0.0)
    measured = {"ttft": sample["ttft_s"], "itl": worst_gap, "tpot": sample["tpot_s"],
                "e2e": sample["e2e_s"]}
    for key, limit in slo.items():
        value = measured[key]
        if value is not None and value > limit:
            return False
    return True


def summarize(samples: list[dict], duration_s: float, slo: dict[str, float]) -> dict:
    """One summary block (for the whole run, a class or a tenant) over request samples:
    completed/failed counts, p50/p90/p99 of TTFT, ITL, TPOT and end-to-end, throughput and
    goodput over the run's duration."""
    done = [s for s in samples if s["status"] == "ok"]
    failed = [s for s in samples if s["status"] == "error"]
    output_tokens = sum(s["output_tokens"] or 0 for s in done)
    input_tokens = sum(s["input_tokens"] or 0 for s in done)
    good = [s for s in done if meets_slo(s, slo)]
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    errors: dict[str, int] = {}
    for s in failed:
        errors[s["error_type"]] = errors.get(s["error_type"], 0) + 1
    return {
        "requests": len(samples),
        "completed": len(done),
        "failed": len(failed),
        "cancelled": sum(1 for s in samples if s["status"] == "cancelled"),
        "errors": errors,
        "ttft_s": distribution([s["ttft_s"] for s in done if s["ttft_s"] is not None]),
        "itl_s": distribution([gap for s in done for gap in s["itl_s"]]),
        "tpot_s": distribution([s["tpot_s"] for s in done if s["tpot_s"] is not None]),
        "e2e_s": distribution([s["e2e_s"] for s in done]),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": per_s(output_tokens),
        "total_tokens_per_s": per_s(input_tokens + output_tokens),
        "requests_per_s": per_s(len(done)),
        "goodput": {"requests_per_s": per_s(len(good)), "requests": len(good),
                    "fraction": len(good) / len(samples) if samples else None, "slo": slo},
    }
