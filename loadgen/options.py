"""What one `tokstream loadtest` run is asked to do, checked on construction. Each field is
declared once, here: loadgen/cli.py generates the flags, their help and defaults from it.
Light on purpose: `tokstream --help` imports it (no httpx, no gevent)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tokstream.errors import UserInputError
from tokstream.gateway_config import ServerConfig
from tokstream.loadgen.mix import ARRIVALS

ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions",
          "responses": "/v1/responses"}
"""--api's choices, and the route each one streams from."""
WEB_PORT = 8089
"""Port of Locust's web UI (--web-port; the UI is off without --web)."""

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str, flag: str = "--duration") -> float:
    match = DURATION.match(text)
    if not match:
        raise UserInputError(f"{flag}: {text!r} is not a duration like 30s, 5m or 1h")
    return float(match.group(1)) * UNITS[match.group(2)]


@dataclass
class Options:
    """Each field is a flag of `tokstream loadtest` (loadgen/cli.py), named after the field
    (a _s suffix dropped), with the first paragraph of its docstring as help, except web_port
    (--web and --web-port)."""

    url: str = f"http://{ServerConfig.host}:{ServerConfig.port}"
    """The server to load.

    The default is where `tokstream serve` listens by default."""
    mix: str = "chat"
    """A mix in profiles/mixes/ (chat, mixed, long-prompt-flood, shared-prefix, hot-tenant,
    agent-never-stops) or a TOML file."""
    api: str = "anthropic"
    """anthropic (/v1/messages), openai (/v1/chat/completions) or responses (/v1/responses,
    nothing stored)."""
    users: int | None = None
    """Closed loop: concurrent users. Open loop (and the sweep's Poisson stages): most requests
    in flight. Default: the mix's."""
    rate: float | None = None
    """Open loop: requests per second (sets --arrival poisson unless given)."""
    capacity_fraction: float | None = None
    """Open loop at this fraction of the server's measured capacity (sets --arrival poisson
    unless given). Default: the mix's capacity_fraction, if it has one."""
    capacity: str | None = None
    """Capacity for a capacity-fraction rate: requests/s, or a file (a sweep's report.json, a
    probe's capacity.json). Default: probe first."""
    probe_duration: str = "20s"
    """How long the capacity probe issues requests (a closed loop of --throughput-users).

    It then drains them."""
    sweep: bool = False
    """Capacity sweep: synchronous, maximum throughput, then --sweep-rates Poisson rates up to
    capacity; each stage bounded by --duration (default 30s) and --requests."""
    sweep_rates: int = 5
    """Sweep: how many constant rates between the synchronous rate and capacity."""
    throughput_users: int = 32
    """Closed-loop users of the sweep's maximum-throughput stage and of the capacity probe."""
    arrival: str | None = None
    """closed, poisson or bursty. Default: the mix's."""
    burstiness: float | None = None
    """bursty: gamma shape of the gaps (< 1 burstier than Poisson)."""
    duration: str | None = None
    """Stop issuing after this long: 30s, 5m, 1h (0 = no limit). Default: the mix's."""
    requests: int | None = None
    """Stop after this many requests (0 = no limit). Default: the mix's."""
    seed: int = 0
    """Same seed, same requests (classes, tenants, lengths, prompts, arrivals)."""
    slo: str = ""
    """Goodput objectives, e.g. ttft=2,itl=0.2 (also tpot, e2e; seconds or 200ms)."""
    keys: str | None = None
    """TOML file: tenant = "api key" for each tenant of the mix."""
    out: str = "loadtest-out"
    """Directory for report.json and the PNG plots."""
    model: str | None = None
    """Model name to send. Default: the server's (/v1/models)."""
    request_timeout_s: float = 600.0
    """Seconds one request may take before it counts as a timeout."""
    drain_timeout_s: float = 120.0
    """After --duration, seconds to let requests in flight finish."""
    max_error_rate: float = 0.01
    """Exit 1 when more than this fraction of requests fail."""
    max_integrity_failures: int = 0
    """Exit 1 when more streams than this fail the integrity check."""
    web_port: int | None = None
    """Port of Locust's web UI; None: no UI (--web turns it on at --web-port)."""

    def __post_init__(self):
        if self.api not in ROUTES:
            raise UserInputError(f"--api: one of {', '.join(ROUTES)}, got {self.api!r}")
        if not re.match(r"^https?://[^/\s]+$", self.url.rstrip("/")):
            raise UserInputError(f"--url: {self.url!r} is not http(s)://HOST[:PORT]")
        self.url = self.url.rstrip("/")
        if self.arrival is not None and self.arrival not in ARRIVALS:
            raise UserInputError(f"--arrival: one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        checks = [("--users", self.users, 1), ("--requests", self.requests, 0),
                  ("--request-timeout", self.request_timeout_s, 1e-9),
                  ("--drain-timeout", self.drain_timeout_s, 0),
                  ("--max-integrity-failures", self.max_integrity_failures, 0),
                  ("--max-error-rate", self.max_error_rate, 0),
                  ("--sweep-rates", self.sweep_rates, 1),
                  ("--throughput-users", self.throughput_users, 1)]
        for flag, value, minimum in checks:
            if value is not None and not (math.isfinite(value) and value >= minimum):
                raise UserInputError(f"{flag}: must be >= {minimum:g}, got {value}")
        for flag, value in (("--rate", self.rate), ("--burstiness", self.burstiness),
                            ("--capacity-fraction", self.capacity_fraction)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UserInputError(f"{flag}: must be > 0, got {value}")
        if self.max_error_rate > 1:
            raise UserInputError("--max-error-rate: a fraction between 0 and 1")
        if self.web_port is not None and not 1 <= self.web_port <= 65535:
            raise UserInputError(f"--web-port: {self.web_port} is not a port")
        if self.rate is not None and self.capacity_fraction is not None:
            raise UserInputError("--rate and --capacity-fraction: give one of them")
        if self.sweep_rates > 50:
            raise UserInputError(f"--sweep-rates: at most 50, got {self.sweep_rates}")
        if self.sweep:
            given = [flag for flag, value in (("--rate", self.rate), ("--arrival", self.arrival),
                                              ("--capacity-fraction", self.capacity_fraction),
                                              ("--capacity", self.capacity),
                                              ("--burstiness", self.burstiness),
                                              ("--web", self.web_port))
                     if value is not None]
            if given:
                raise UserInputError(f"--sweep sets its own rates: {', '.join(given)} "
                                     "cannot go with it")
        if not parse_duration(self.probe_duration, "--probe-duration") > 0:
            raise UserInputError("--probe-duration: must be > 0")
