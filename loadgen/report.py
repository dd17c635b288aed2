"""report.json: every sample, and summaries for the run, each workload class and each tenant.

Each summary block (tokstream.loadgen.metrics.summarize) has completed, failed, ttft_s, itl_s,
tpot_s, e2e_s (p50/p90/p99), output_tokens_per_s and goodput. The run's summary adds the
integrity check (every stream: ends exactly once, indices contiguous, digest and usage match
the tokens received), clamped and mis-sized prompts, late open-loop arrivals and the fairness
block (tokstream.loadgen.fairness: Jain's index against each tenant's max-min fair share, and
the raw and TTFT indexes), and the server's speculative decoding over the run when it has
it (tokstream.loadgen.metrics.speculation_over_run: drafted and accepted tokens, acceptance
rate; the server's counters, so other traffic during the run counts too).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokstream.loadgen.fairness import fairness
from tokstream.loadgen.metrics import request_timings, summarize
from tokstream.stats import percentile

LATE_S = 0.1
"""An open-loop request that started this much after its arrival time counts as late."""


def complete_sample(raw: dict) -> dict:
    """A sample as the Locust process wrote it, plus its timings."""
    sample = dict(raw)
    times = [raw["start_s"] + t for t in raw["event_times_s"]]
    timings = request_timings(raw["start_s"], times, raw["event_tokens"],
                              raw["start_s"] + (raw["end_s"] or 0.0))
    sample.update(timings)
    if sample["status"] != "ok":
        sample["tpot_s"] = None
    return sample


def read_samples(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return sorted((complete_sample(json.loads(line)) for line in lines if line.strip()),
                  key=lambda s: s["index"])


def run_span(samples: list[dict]) -> float:
    """Seconds from the first request sent to the last one ended."""
    if not samples:
        return 0.0
    first = min(s["start_s"] for s in samples)
    return max(s["start_s"] + s["e2e_s"] for s in samples) - first


def integrity_summary(samples: list[dict]) -> dict:
    problems: dict[str, int] = {}
    failed_streams = 0
    for sample in samples:
        if sample["integrity"]:
            failed_streams += 1
        for problem in sample["integrity"]:
            problems[problem["kind"]] = problems.get(problem["kind"], 0) + 1
    checked = sum(1 for s in samples if s.get("http_status") == 200)
    return {"streams_checked": checked, "streams_failed": failed_streams, "problems": problems}


def build_report(samples: list[dict], config: dict, slo: dict, extra: dict,
                 speculation: dict | None = None) -> dict:
    """Every class and tenant of the mix gets a block, those that sent nothing included; the
    summary has speculation only when given (the server speculated)."""
    duration = run_span(samples)
    mix = config["mix"]
    classes = sorted({c["name"] for c in mix["classes"]} | {s["workload"] for s in samples})
    tenants = sorted(set(mix["tenants"]) | {s["tenant"] for s in samples})
    per_class = {c: summarize([s for s in samples if s["workload"] == c], duration, slo)
                 for c in classes}
    per_tenant = {t: summarize([s for s in samples if s["tenant"] == t], duration, slo)
                  for t in tenants}
    served = sum(b["input_tokens"] + b["output_tokens"] for b in per_tenant.values())
    for tenant, block in per_tenant.items():
        block["share_of_requests"] = block["requests"] / len(samples) if samples else None
        block["share_of_tokens"] = ((block["input_tokens"] + block["output_tokens"]) / served
                                    if served else None)
    summary = summarize(samples, duration, slo)
    late = [s["start_s"] - s["scheduled_s"] for s in samples if s.get("scheduled_s") is not None]
    summary.update({
        "duration_s": duration,
        "clamped": sum(1 for s in samples if s["clamped"]),
        "raised_to_minimum": sum(1 for s in samples if s["raised"]),
        "prompt_tokens_mismatched": sum(
            1 for s in samples if s.get("input_tokens") is not None
            and s["input_tokens"] != s["prompt_tokens"]),
        "late_arrivals": sum(1 for lag in late if lag > LATE_S),
        "arrival_lag_p99_s": percentile(late, 99),
        "integrity": integrity_summary(samples),
        "fairness": fairness(samples, per_tenant, mix.get("tenant_weights")),
    })
    if speculation is not None:
        summary["speculation"] = speculation
    for tenant, block in per_tenant.items():
        block["fair_share"] = summary["fairness"]["per_tenant"].get(tenant)
    return {"version": 1, "config": config, **extra, "summary": summary, "class": per_class,
            "tenant": per_tenant, "samples": samples}


def verdict(report: dict, max_error_rate: float, max_integrity_failures: int) -> list[str]:
    """Why the run failed (empty when it passed)."""
    summary = report["summary"]
    reasons = []
    unfinished = summary["failed"] + summary["cancelled"]
    if summary["requests"] == 0:
        reasons.append("no request was sent")
    elif unfinished / summary["requests"] > max_error_rate:
        # A request still running when the drain timeout ran out never served its user either.
        reasons.append(f"{summary['failed']} of {summary['requests']} requests failed "
                       f"({summary['errors']}) and {summary['cancelled']} were still running "
                       f"at the drain timeout, above --max-error-rate {max_error_rate:g}")
    bad = summary["integrity"]["streams_failed"]
    if bad > max_integrity_failures:
        reasons.append(f"{bad} streams failed the integrity check "
                       f"({summary['integrity']['problems']}), above "
                       f"--max-integrity-failures {max_integrity_failures}")
    if summary["prompt_tokens_mismatched"]:
        reasons.append(f"{summary['prompt_tokens_mismatched']} prompts were not the length "
                       "asked for (the server counted other input tokens)")
    return reasons
