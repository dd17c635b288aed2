"""The metric math of a load test, pure: percentiles, per-request timings, goodput, Jain's index.

Definitions (vllm bench serve's, so numbers compare):
- TTFT: request sent -> first token-carrying event.
- ITL: every gap between consecutive token-carrying events of one request.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request with at least 2 output tokens.
- Goodput: requests per second that completed and met every SLO given. The ITL objective holds
  for a request when its worst gap is within it: a reader sees the longest stall, not the mean.
- Jain's index over per-tenant throughput x: (sum x)^2 / (n * sum x^2); 1 is perfectly even,
  1/n is one tenant taking everything.
- Speculative decoding over a run (vLLM's spec_decode counters, read from the server's /metrics
  before and after it): acceptance rate = accepted / drafted tokens; mean acceptance length =
  1 + accepted tokens / drafts (tokens a verify step yields); per position i, drafts accepted
  at position i / drafts.
"""

from __future__ import annotations

import math

from tokstream.stats import percentile

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")
SPEC_DECODE = {"vllm:spec_decode_num_drafts_total": "drafts",
               "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
               "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens"}
"""The spec_decode samples read from /metrics (summed over labels) -> the report's names."""
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
"""Summed over labels but position, into accepted_per_position."""


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


def spec_decode_counters(text: str) -> dict | None:
    """The spec_decode counters of a Prometheus text exposition: drafts, draft_tokens,
    accepted_tokens and accepted_per_position (position 0 first). None when it has none of
    them (a server without speculative decoding, as vLLM's without a speculative config)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {name: 0.0 for name in SPEC_DECODE.values()}
    per_position: dict[int, float] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SPEC_DECODE:
                counters[SPEC_DECODE[sample.name]] += sample.value
                seen = True
            elif sample.name == SPEC_PER_POSITION and "position" in sample.labels:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    if not seen:
        return None
    counters["accepted_per_position"] = [per_position.get(i, 0.0)
                                         for i in range(max(per_position, default=-1) + 1)]
    return counters


def speculation_over_run(before: dict | None, after: dict | None) -> dict | None:
    """A run's speculative decoding from spec_decode_counters before and after it: the counter
    deltas and the rates over them (None where nothing was drafted). None when the server has
    no speculation: no counters, or none drafted by the run's end (tokstream keeps them at zero
    with speculation off). counters_reset: a counter went down (the engine core restarted
    during the run), so the figures count from that restart only."""
    if before is None or after is None or not after["draft_tokens"]:
        return None
    names = list(SPEC_DECODE.values())
    reset = any(after[name] < before[name] for name in names) or any(
        a < b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"]))
    start = ({**dict.fromkeys(names, 0.0), "accepted_per_position": []} if reset
             else before)
    delta = {name: round(after[name] - start[name]) for name in names}
    positions = after["accepted_per_position"]
    earlier = start["accepted_per_position"] + [0.0] * len(positions)
    per_position = [round(count - earlier[i]) for i, count in enumerate(positions)]
    drafts, drafted, accepted = delta["drafts"], delta["draft_tokens"], delta["accepted_tokens"]
    return {**delta, "accepted_per_position": per_position,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_position": [count / drafts for count in per_position]
            if drafts else [],
            "counters_reset": reset}
