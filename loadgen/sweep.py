"""`tokstream loadtest --sweep`: latency against offered load, from one request at a time to
the server's capacity (GuideLLM's "sweep" profile).

1. synchronous: one user, back to back; its achieved rate is the synchronous rate;
2. throughput: a closed loop of --throughput-users users; its achieved rate is the capacity;
3. --sweep-rates constant rates (Poisson arrivals), evenly spaced above the synchronous rate
   up to the capacity: rate n = sync + n (capacity - sync) / K for n = 1..K.

Every stage is one Locust run of the mix's main arrivals (bursts left out: a rate is the main
arrivals'), bounded by --duration (default 30 s a stage) and --requests, then drained for at
most --drain-timeout; its full report.json lands in --out/stages/NN-kind[-rate]/. The sweep's
own report.json has a `sweep` block (one row a stage: offered and achieved rate, output
tokens/s, TTFT and ITL p50/p90/p99, completed/failed), its capacity.json can be handed to a
later run (`--capacity FILE`), and sweep.png plots latency and throughput against offered rate.
The capacity probe of a plain run is the throughput stage alone, shorter.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from tokstream.errors import UserInputError
from tokstream.loadgen.capacity import Capacity, capacity_from_summary, write_capacity
from tokstream.loadgen.mix import Mix
from tokstream.loadgen.runner import Options, Session, parse_duration, run_stage

STAGE_S = 30.0
"""Default issuing time of each sweep stage (a sweep runs 2 + --sweep-rates of them)."""
KINDS = ("synchronous", "throughput", "constant")
PROBE_REQUESTS_PER_USER = 4
"""The capacity probe stops after this many requests a user (or at --probe-duration)."""


@dataclass
class SweepBounds:
    """How long and how much each stage may send, and its concurrency."""

    duration_s: float
    """Each stage stops issuing after this long (0: no limit)."""
    requests: int
    """Each stage stops after this many requests (0: no limit)."""
    rates: int
    """Constant rates between the synchronous rate and capacity."""
    throughput_users: int
    """Closed-loop users of the maximum-throughput stage."""
    open_users: int
    """Constant stages: the most requests in flight (well above the throughput stage's, so
    an offered rate near capacity queues at the server, not in the load generator)."""

    def __post_init__(self):
        if not self.duration_s and not self.requests:
            raise UserInputError("no bound: give --duration or --requests (or both) per stage")
        if self.rates < 1 or self.throughput_users < 1 or self.open_users < 1:
            raise UserInputError("--sweep-rates, --throughput-users and --users must be >= 1")

    @classmethod
    def from_options(cls, options: Options, mix: Mix) -> "SweepBounds":
        duration = parse_duration(options.duration) if options.duration is not None else STAGE_S
        requests = options.requests if options.requests is not None else mix.run.requests
        return cls(duration, requests, options.sweep_rates, options.throughput_users,
                   options.users or max(64, 2 * options.throughput_users))


@dataclass
class Stage:
    """One constant load: a closed loop of `users`, or Poisson arrivals at `rate`."""

    kind: str
    """synchronous | throughput | constant."""
    users: int
    """Closed loop: concurrent users; constant: the most requests in flight."""
    rate: float | None
    """constant: offered requests per second (None for the closed loops)."""
    duration_s: float
    requests: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "constant") != (self.rate is not None):
            raise ValueError("rate: a constant stage has one, a closed loop has none")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate: must be > 0, got {self.rate}")

    @property
    def arrival(self) -> str:
        return "poisson" if self.kind == "constant" else "closed"

    def name(self, number: int) -> str:
        suffix = f"-{self.rate:.4g}" if self.rate is not None else ""
        return f"{number:02d}-{self.kind}{suffix}"

    def describe(self) -> str:
        bounds = " and ".join(filter(None, [f"{self.duration_s:g} s" if self.duration_s else "",
                                            f"{self.requests} requests" if self.requests
                                            else ""]))
        load = (f"Poisson {self.rate:.3g} req/s" if self.rate is not None
                else f"closed loop, {self.users} user{'s' if self.users > 1 else ''}")
        return f"{self.kind}: {load}, at most {bounds}"

    def settings(self) -> dict:
        """The Locust run's settings (runner.settings_for's shape)."""
        return {"arrival": self.arrival, "users": self.users, "rate": self.rate,
                "capacity_fraction": None, "burstiness": 1.0, "duration_s": self.duration_s,
                "requests": self.requests}


def plan_rates(synchronous: float, capacity: float, count: int) -> list[float]:
    """`count` offered rates evenly spaced above the synchronous rate, the last at capacity.
    A capacity no higher than the synchronous rate (a server that gains nothing from
    concurrency, or noise) leaves nothing between: one rate, the synchronous one."""
    if count < 1:
        raise ValueError(f"count: at least 1, got {count}")
    if not synchronous > 0:
        raise ValueError(f"synchronous: must be > 0, got {synchronous}")
    if capacity <= synchronous:
        return [synchronous]
    step = (capacity - synchronous) / count
    return [synchronous + step * n for n in range(1, count)] + [capacity]


def closed_stages(bounds: SweepBounds) -> list[Stage]:
    return [Stage("synchronous", 1, None, bounds.duration_s, bounds.requests),
            Stage("throughput", bounds.throughput_users, None, bounds.duration_s,
                  bounds.requests)]


def constant_stages(bounds: SweepBounds, rates: list[float]) -> list[Stage]:
    return [Stage("constant", bounds.open_users, rate, bounds.duration_s, bounds.requests)
            for rate in rates]


def _p(block: dict) -> dict:
    return {q: block[q] for q in ("p50", "p90", "p99")}


def stage_row(stage: Stage, name: str, report: dict, out: Path) -> dict:
    """One line of the sweep block: what the stage offered and what it got."""
    summary = report["summary"]
    return {
        "name": name, "kind": stage.kind, "arrival": stage.arrival, "users": stage.users,
        "offered_requests_per_s": stage.rate,
        "duration_s": stage.duration_s, "requests_limit": stage.requests,
        "span_s": summary["duration_s"], "sent": summary["requests"],
        "completed": summary["completed"], "failed": summary["failed"],
        "cancelled": summary["cancelled"],
        "achieved_requests_per_s": summary["requests_per_s"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "goodput_requests_per_s": summary["goodput"]["requests_per_s"],
        "ttft_s": _p(summary["ttft_s"]), "itl_s": _p(summary["itl_s"]),
        "late_arrivals": summary["late_arrivals"],
        "integrity_failed": summary["integrity"]["streams_failed"],
        "prompt_tokens_mismatched": summary["prompt_tokens_mismatched"],
        "report": str((out / "report.json").relative_to(out.parents[1])),
    }


class Sweep:
    """Runs the stages one after another and keeps their rows."""

    def __init__(self, session: Session, bounds: SweepBounds):
        self.session, self.bounds = session, bounds
        self.mix = session.mix.without_bursts()
        self.rows: list[dict] = []
        self.interrupted = False
        self.planned = 2 + bounds.rates

    def run(self, stage: Stage) -> dict:
        number = len(self.rows) + 1
        name = stage.name(number)
        print(f"sweep stage {number}/{self.planned} {stage.describe()}", file=sys.stderr)
        out = self.session.out / "stages" / name
        result = run_stage(self.session, stage.settings(), out, self.mix, plots=False)
        row = stage_row(stage, name, result.report, out)
        self.rows.append(row)
        self.interrupted = result.interrupted
        return row


def probe_capacity(session: Session) -> Capacity:
    """A plain run's capacity probe: the throughput stage alone, --probe-duration long (and at
    most PROBE_REQUESTS_PER_USER requests a user); writes capacity.json in --out."""
    options = session.options
    users = options.throughput_users
    stage = Stage("throughput", users, None,
                  parse_duration(options.probe_duration, "--probe-duration"),
                  PROBE_REQUESTS_PER_USER * users)
    print(f"capacity probe ({stage.describe()}; --capacity FILE skips it)", file=sys.stderr)
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result = run_stage(session, stage.settings(), session.out / "capacity-probe",
                       session.mix.without_bursts(), plots=False)
    if result.interrupted:
        raise KeyboardInterrupt
    capacity = capacity_from_summary(result.report["summary"], users, session.mix.name,
                                     "probe", options.url, at)
    write_capacity(capacity, session.out)
    return capacity


def sweep_verdict(rows: list[dict], options: Options) -> list[str]:
    """Why the sweep failed. Failures and cancellations at the constant rates are what a
    sweep measures (the top rates overload on purpose); a synchronous stage that fails, a
    broken stream or a mis-sized prompt anywhere are not."""
    reasons = []
    sync = next((r for r in rows if r["kind"] == "synchronous"), None)
    if sync is not None and sync["sent"]:
        unfinished = sync["failed"] + sync["cancelled"]
        if unfinished / sync["sent"] > options.max_error_rate:
            reasons.append(f"the synchronous stage (one request at a time) lost {unfinished} "
                           f"of {sync['sent']} requests, above --max-error-rate "
                           f"{options.max_error_rate:g}")
    broken = sum(r["integrity_failed"] for r in rows)
    if broken > options.max_integrity_failures:
        reasons.append(f"{broken} streams failed the integrity check, above "
                       f"--max-integrity-failures {options.max_integrity_failures}")
    mismatched = sum(r["prompt_tokens_mismatched"] for r in rows)
    if mismatched:
        reasons.append(f"{mismatched} prompts were not the length asked for")
    return reasons


def run_sweep(session: Session, bounds: SweepBounds) -> int:
    """Synchronous, throughput, then the constant rates; report, capacity.json, sweep.png."""
    options = session.options
    sweep = Sweep(session, bounds)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    capacity: Capacity | None = None
    synchronous_rate = None
    rates: list[float] = []
    reasons: list[str] = []
    sync_stage, throughput_stage = closed_stages(bounds)
    row = sweep.run(sync_stage)
    if not sweep.interrupted:
        synchronous_rate = row["achieved_requests_per_s"]
        if not row["completed"]:
            reasons.append("the synchronous stage completed no request: nothing to sweep")
    if not sweep.interrupted and not reasons:
        row = sweep.run(throughput_stage)
        try:
            capacity = capacity_from_summary(
                {"completed": row["completed"], "requests_per_s": row["achieved_requests_per_s"],
                 "output_tokens_per_s": row["output_tokens_per_s"], "failed": row["failed"],
                 "cancelled": row["cancelled"]}, throughput_stage.users, session.mix.name,
                "sweep", options.url, started_at)
        except UserInputError as error:
            reasons.append(str(error))
    if capacity is not None and not sweep.interrupted:
        rates = plan_rates(synchronous_rate, capacity.requests_per_s, bounds.rates)
        sweep.planned = 2 + len(rates)
        for stage in constant_stages(bounds, rates):
            sweep.run(stage)
            if sweep.interrupted:
                break
    reasons = sweep_verdict(sweep.rows, options) + reasons
    report = {
        "version": 1, "kind": "sweep", "started_at": started_at,
        "config": {"url": options.url, "api": options.api, "model": session.prepared["model"],
                   "context": session.prepared["context"], "mix_name": session.mix.name,
                   "seed": options.seed, "slo": session.slo,
                   "drain_timeout_s": options.drain_timeout_s,
                   "request_timeout_s": options.request_timeout_s, "bounds": asdict(bounds)},
        "sweep": {"synchronous_requests_per_s": synchronous_rate,
                  "capacity": capacity.row() if capacity else None,
                  "rates": rates,
                  "bursts_left_out": bool(session.mix.burst_classes),
                  "stages": sweep.rows},
        "verdict": {"ok": not reasons, "reasons": reasons},
    }
    (session.out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    if capacity is not None:
        write_capacity(capacity, session.out)
    from tokstream.loadgen.plots import plot_sweep
    from tokstream.loadgen.tables import print_sweep

    plot_sweep(report, session.out)
    print_sweep(report)
    print(f"report: {session.out / 'report.json'}; plot: {session.out / 'sweep.png'}; "
          f"stages: {session.out / 'stages'}")
    if sweep.interrupted:
        return 130
    return 1 if reasons else 0
