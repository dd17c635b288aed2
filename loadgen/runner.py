"""The `tokstream loadtest` parent: prepare, run Locust in a child process, report.

Prepare (here, no gevent): read the mix and keys, ask the server its model and context, size
prompts with count_tokens and check a sample of lengths: once per call (a Session). Run a
stage: the child (tokstream.loadgen.locust_run) gets one JSON file and streams progress lines
back; it dies with this process; the samples it wrote are summarised into that stage's
report.json. A plain run is one stage (after a capacity probe when the mix states its rate as
a fraction of capacity); a sweep (tokstream.loadgen.sweep) is several.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from tokstream.errors import UserInputError
from tokstream.toml_file import read_toml
from tokstream.loadgen import metrics
from tokstream.loadgen.locust_child import run_locust
from tokstream.loadgen.mix import Mix
from tokstream.loadgen.options import Options, parse_duration
from tokstream.loadgen.plan import Limits, build_spec
from tokstream.loadgen.prompts import TokenCounter, calibrate, verify
from tokstream.loadgen.report import build_report, read_samples, verdict


def settings_for(options: Options, mix: Mix) -> dict:
    """The run's arrivals and bounds: flags over the mix's [run] defaults. A rate stated as a
    fraction of capacity leaves "rate" None and "capacity_fraction" set: the caller measures
    (or reads) the capacity and fills the rate in."""
    run = mix.run
    flag_rate = options.rate is not None or options.capacity_fraction is not None
    arrival = options.arrival or ("poisson" if flag_rate and run.arrival == "closed"
                                  else run.arrival)
    fraction = options.capacity_fraction
    if fraction is None and options.rate is None:
        fraction = run.capacity_fraction
    if arrival == "closed":
        fraction = None  # a closed loop's load is its users
    settings = {
        "arrival": arrival,
        "users": options.users or (run.users if arrival == "closed" else max(run.users, 64)),
        "rate": None if fraction is not None
        else options.rate if options.rate is not None else run.rate,
        "capacity_fraction": fraction,
        "burstiness": options.burstiness if options.burstiness is not None else run.burstiness,
        "duration_s": parse_duration(options.duration) if options.duration is not None
        else run.duration_s,
        "requests": options.requests if options.requests is not None else run.requests,
    }
    if arrival != "closed" and fraction is None and settings["rate"] <= 0:
        raise UserInputError(f"--rate: open-loop arrivals ({arrival}) need a rate > 0")
    if not settings["duration_s"] and not settings["requests"]:
        raise UserInputError("no bound: give --duration or --requests (or both)")
    return settings


def load_keys(path: str | None, mix: Mix) -> dict[str, str]:
    """{tenant: api key}; every tenant of the mix needs one when a keys file is given."""
    if path is None:
        return {}
    data = read_toml(path, "--keys")
    keys = data.get("keys", data)
    if not isinstance(keys, dict) or not all(isinstance(v, str) and v for v in keys.values()):
        raise UserInputError(f"--keys {path}: expected tenant = \"key\" lines")
    missing = sorted(set(mix.tenants) - set(keys))
    if missing:
        raise UserInputError(f"--keys {path}: no key for tenant(s) {', '.join(missing)} "
                             f"of mix {mix.name}")
    return {t: keys[t] for t in mix.tenants}


def server_model(client: httpx.Client, url: str, headers: dict) -> dict:
    try:
        response = client.get(url + "/v1/models", headers=headers)
    except httpx.HTTPError as error:
        raise UserInputError(f"cannot reach the server at {url}: {error}") from None
    if response.status_code != 200:
        raise UserInputError(f"{url}/v1/models answered {response.status_code}: "
                             f"{response.text[:200]}")
    try:
        models = response.json().get("data") or []
    except (ValueError, AttributeError):
        models = []
    if not models:
        raise UserInputError(f"{url} serves no model")
    return models[0]


def sample_lengths(mix: Mix, limits: Limits, seed: int) -> list[tuple[str, int]]:
    """Lengths to count before the run: each class's shortest and longest (after clamping)."""
    import random

    lengths = set()
    for workload in mix.classes:
        for bound in workload.prompt_tokens:
            fixed = type(workload)(**{**asdict(workload), "prompt_tokens": (bound, bound)})
            spec = build_spec(mix, limits, fixed, "x", random.Random(seed), 0, None)
            lengths.add((workload.name, spec.prompt_tokens))
    return sorted(lengths)


def prepare(options: Options, mix: Mix, keys: dict[str, str]) -> dict:
    """Everything the Locust process needs, as plain data."""
    headers = {"x-api-key": next(iter(keys.values()))} if keys else {}
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        model = server_model(client, options.url, headers)
        count = TokenCounter(client, options.url, options.model or model["id"], headers)
        book = calibrate(count, {c.name: c.shared_prefix_tokens for c in mix.classes},
                         options.seed)
        context = model.get("max_model_len")
        if not isinstance(context, int):
            raise UserInputError(f"{options.url}/v1/models does not say the context "
                                 "(max_model_len)")
        limits = Limits(context, dict(book.base))
        try:
            lengths = sample_lengths(mix, limits, options.seed)
        except ValueError as error:
            raise UserInputError(str(error)) from None
        mismatches = verify(book, count, lengths, options.seed)
    if mismatches:
        raise UserInputError(f"prompts cannot be sized exactly on this server's tokenizer: "
                             f"{mismatches[:3]}")
    return {"model": options.model or model["id"], "context": context, "book": book.row(),
            "limits": asdict(limits), "verified_lengths": lengths}


@dataclass
class Session:
    """What every stage of one `loadtest` call shares, read and measured once."""

    options: Options
    mix: Mix
    keys: dict[str, str]
    """Tenant -> API key (empty: no keys)."""
    slo: dict[str, float]
    out: Path
    prepared: dict
    """prepare()'s plain data: model, context, prompt book, limits, verified lengths."""


def open_session(options: Options, mix: Mix) -> Session:
    """Read the SLO and keys, make --out, and size prompts against the server."""
    try:
        slo = metrics.parse_slo(options.slo)
    except ValueError as error:
        raise UserInputError(str(error)) from None
    keys = load_keys(options.keys, mix)
    out = Path(options.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserInputError(f"--out: cannot create {out}: {error.strerror}") from None
    return Session(options, mix, keys, slo, out, prepare(options, mix, keys))


def read_spec_decode(url: str) -> dict | None:
    """The server's spec_decode counters from /metrics (metrics.spec_decode_counters), None
    when it has none or cannot be read: a run's report then has no speculation, and says
    nothing else about it (a server with tenants wants a key for /metrics, unless its load
    series are public)."""
    try:
        response = httpx.get(url + "/metrics", timeout=10.0)
        response.raise_for_status()
        return metrics.spec_decode_counters(response.text)
    except (httpx.HTTPError, ValueError):  # ValueError: not a Prometheus exposition
        return None


@dataclass
class StageResult:
    """One Locust run, summarised (its report.json is written in its directory)."""

    report: dict
    reasons: list[str]
    """Why it failed the run's thresholds (empty when it passed)."""
    interrupted: bool
    """Ctrl-C stopped it: the report covers what was recorded until then."""


def run_stage(session: Session, settings: dict, out: Path, mix: Mix | None = None,
              plots: bool = True) -> StageResult:
    """Run Locust once with `settings` (and `mix`, default the session's) and write its
    report.json (and, with `plots`, its PNGs) in `out`."""
    options, mix = session.options, mix or session.mix
    out.mkdir(parents=True, exist_ok=True)
    prepared = session.prepared
    results = out / "samples.jsonl"
    results.unlink(missing_ok=True)
    config = {"url": options.url, "api": options.api, "model": prepared["model"],
              "seed": options.seed, "mix": asdict(mix), "settings": settings,
              "book": prepared["book"], "limits": prepared["limits"], "keys": session.keys,
              "results_path": str(results), "request_timeout_s": options.request_timeout_s,
              "drain_timeout_s": options.drain_timeout_s, "progress_interval_s": 1.0,
              "web_port": options.web_port}
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    limit_s = (settings["duration_s"] or 1e9) + options.drain_timeout_s + 60
    if not settings["duration_s"]:
        limit_s = settings["requests"] * options.request_timeout_s + 60
    counters_before = read_spec_decode(options.url)
    done = run_locust(config, out, limit_s)
    speculation = metrics.speculation_over_run(counters_before, read_spec_decode(options.url))
    samples = read_samples(results)
    public = {k: v for k, v in config.items() if k not in ("keys", "book", "results_path")}
    public.update(mix_name=mix.name, tenants_with_keys=sorted(session.keys),
                  context=prepared["context"], verified_lengths=prepared["verified_lengths"],
                  slo=session.slo, max_error_rate=options.max_error_rate,
                  max_integrity_failures=options.max_integrity_failures)
    report = build_report(samples, public, session.slo,
                          {"started_at": started_at, "locust": done.get("locust_stats", {})},
                          speculation)
    reasons = verdict(report, options.max_error_rate, options.max_integrity_failures)
    report["verdict"] = {"ok": not reasons, "reasons": reasons}
    (out / "report.json").write_text(json.dumps(report), encoding="utf-8")
    if plots:
        from tokstream.loadgen.plots import plot_report

        plot_report(report, out)
    results.unlink(missing_ok=True)
    return StageResult(report, reasons, bool(done.get("interrupted")))

