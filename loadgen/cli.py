"""`tokstream loadtest`: Locust-driven workload mixes against a running server."""

from typing import Optional

import typer

# The defaults come from the run's options (one declaration each); the module is light.
from tokstream.loadgen.options import WEB_PORT, Options


def loadtest(
    url: str = typer.Option(Options.url, help="The server to load."),
    mix: str = typer.Option(Options.mix, help="A mix in profiles/mixes/ (chat, mixed, long-prompt-flood, shared-prefix, hot-tenant, agent-never-stops) or a TOML file."),
    api: str = typer.Option(Options.api, help="anthropic (/v1/messages) or openai (/v1/chat/completions)."),
    users: Optional[int] = typer.Option(None, help="Closed loop: concurrent users. Open loop (and the sweep's Poisson stages): most requests in flight. Default: the mix's."),
    rate: Optional[float] = typer.Option(None, help="Open loop: requests per second (sets --arrival poisson unless given)."),
    capacity_fraction: Optional[float] = typer.Option(None, help="Open loop at this fraction of the server's measured capacity (sets --arrival poisson unless given). Default: the mix's capacity_fraction, if it has one."),
    capacity: Optional[str] = typer.Option(None, help="Capacity for a capacity-fraction rate: requests/s, or a file (a sweep's report.json, a probe's capacity.json). Default: probe first."),
    probe_duration: str = typer.Option(Options.probe_duration, help="How long the capacity probe issues requests (a closed loop of --throughput-users)."),
    sweep: bool = typer.Option(Options.sweep, "--sweep", help="Capacity sweep: synchronous, maximum throughput, then --sweep-rates Poisson rates up to capacity; each stage bounded by --duration (default 30s) and --requests."),
    sweep_rates: int = typer.Option(Options.sweep_rates, help="Sweep: how many constant rates between the synchronous rate and capacity."),
    throughput_users: int = typer.Option(Options.throughput_users, help="Closed-loop users of the sweep's maximum-throughput stage and of the capacity probe."),
    arrival: Optional[str] = typer.Option(None, help="closed, poisson or bursty. Default: the mix's."),
    burstiness: Optional[float] = typer.Option(None, help="bursty: gamma shape of the gaps (< 1 burstier than Poisson)."),
    duration: Optional[str] = typer.Option(None, help="Stop issuing after this long: 30s, 5m, 1h (0 = no limit). Default: the mix's."),
    requests: Optional[int] = typer.Option(None, help="Stop after this many requests (0 = no limit). Default: the mix's."),
    seed: int = typer.Option(Options.seed, help="Same seed, same requests (classes, tenants, lengths, prompts, arrivals)."),
    slo: str = typer.Option(Options.slo, help="Goodput objectives, e.g. ttft=2,itl=0.2 (also tpot, e2e; seconds or 200ms)."),
    keys: Optional[str] = typer.Option(None, help="TOML file: tenant = \"api key\" for each tenant of the mix."),
    out: str = typer.Option(Options.out, help="Directory for report.json and the PNG plots."),
    model: Optional[str] = typer.Option(None, help="Model name to send. Default: the server's (/v1/models)."),
    request_timeout: float = typer.Option(Options.request_timeout_s, help="Seconds one request may take before it counts as a timeout."),
    drain_timeout: float = typer.Option(Options.drain_timeout_s, help="After --duration, seconds to let requests in flight finish."),
    max_error_rate: float = typer.Option(Options.max_error_rate, help="Exit 1 when more than this fraction of requests fail."),
    max_integrity_failures: int = typer.Option(Options.max_integrity_failures, help="Exit 1 when more streams than this fail the integrity check."),
    web: bool = typer.Option(False, "--web", help="Open Locust's web UI on 127.0.0.1 while the run goes."),
    web_port: int = typer.Option(WEB_PORT, help="Port of Locust's web UI."),
):
    """Load a server with a workload mix (Locust in its own process), or sweep it from one
    request at a time to capacity (--sweep); report to the terminal, report.json and PNG plots
    in --out. Exit 1 when errors or integrity failures pass the thresholds, 2 on bad input."""
    from tokstream.errors import UserInputError
    from tokstream.loadgen.loadtest import run

    try:
        options = Options(url=url, mix=mix, api=api, users=users, rate=rate, arrival=arrival,
                          burstiness=burstiness, duration=duration, requests=requests, seed=seed,
                          slo=slo, keys=keys, out=out, model=model,
                          request_timeout_s=request_timeout, drain_timeout_s=drain_timeout,
                          max_error_rate=max_error_rate,
                          max_integrity_failures=max_integrity_failures,
                          web_port=web_port if web else None, sweep=sweep,
                          sweep_rates=sweep_rates, throughput_users=throughput_users,
                          capacity=capacity, capacity_fraction=capacity_fraction,
                          probe_duration=probe_duration)
        code = run(options)
    except UserInputError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        raise typer.Exit(130)
    raise typer.Exit(code)
