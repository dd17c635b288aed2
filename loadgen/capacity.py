"""A server's measured capacity for a mix, and rates stated as a fraction of it.

Capacity is the request rate a closed loop of many users achieves on the mix's main arrivals
(bursts left out): completed requests / the stage's span, from the first request sent to the
last one ended. The span includes the drain of the last requests, so the figure leans low:
a rate stated as a fraction of it leans to the safe side. It comes from a sweep's maximum-
throughput stage, a short probe of the same kind before a run, or a file (`--capacity FILE`:
a sweep's report.json or a probe's capacity.json), or is given as a number.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tokstream.errors import UserInputError

CAPACITY_FILE = "capacity.json"
"""Written next to report.json by a probe or a sweep; `--capacity` reads it back."""


@dataclass
class Capacity:
    """Requests per second a mix's main arrivals reach on one server at full concurrency."""

    requests_per_s: float
    """Completed requests / span of the maximum-throughput closed loop."""
    output_tokens_per_s: float | None
    """Output tokens/s of that same stage (None when given as a bare number)."""
    users: int | None
    """Concurrent users of the closed loop that measured it."""
    mix: str | None
    """The mix it was measured on (a capacity in requests/s belongs to its request sizes)."""
    source: str
    """probe, sweep, a file's path, or given (a number on the command line)."""
    url: str | None = None
    measured_at: str | None = None

    def __post_init__(self):
        if not (math.isfinite(self.requests_per_s) and self.requests_per_s > 0):
            raise UserInputError(f"capacity: {self.requests_per_s!r} requests/s is not a "
                                 "positive rate")

    def row(self) -> dict:
        return asdict(self)


def rate_from_fraction(fraction: float, capacity: Capacity) -> float:
    """The open-loop rate a mix's capacity_fraction asks for on this server."""
    return fraction * capacity.requests_per_s


def capacity_from_summary(summary: dict, users: int, mix: str, source: str, url: str,
                          measured_at: str) -> Capacity:
    """A maximum-throughput stage's summary -> its capacity; one that completed nothing
    measured nothing, and says how to get a figure anyway."""
    if not summary["completed"] or not summary["requests_per_s"]:
        raise UserInputError(f"the maximum-throughput {source} ({users} users) completed no "
                             f"request ({summary['failed']} failed, {summary['cancelled']} "
                             "still running at the drain timeout): give --capacity REQ_PER_S, "
                             "or a longer --probe-duration / --drain-timeout")
    return Capacity(summary["requests_per_s"], summary["output_tokens_per_s"], users, mix,
                    source, url, measured_at)


def read_capacity(text: str, mix: str) -> Capacity:
    """`--capacity`: a number of requests/s, or a file holding a measured capacity (a probe's
    capacity.json or a sweep's report.json). A capacity measured on another mix is used with
    a warning: its requests were another size."""
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        return Capacity(number, None, None, None, "given")
    path = Path(text)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserInputError(f"--capacity: {text!r} is neither a number of requests/s nor a "
                             "file") from None
    except (OSError, ValueError) as error:
        raise UserInputError(f"--capacity {path}: {error}") from None
    found = None
    if isinstance(data, dict):
        found = data.get("capacity") or (data.get("sweep") or {}).get("capacity")
    if not isinstance(found, dict) or not isinstance(found.get("requests_per_s"), (int, float)):
        raise UserInputError(f"--capacity {path}: no measured capacity in it (a sweep's "
                             f"report.json or a probe's {CAPACITY_FILE})")
    fields = {k: found.get(k) for k in Capacity.__dataclass_fields__}
    capacity = Capacity(**{**fields, "source": f"{found.get('source')} via {path}"})
    if capacity.mix is not None and capacity.mix != mix:
        print(f"warning: --capacity {path} was measured on mix {capacity.mix}, this run is "
              f"{mix}: its requests may be another size", file=sys.stderr)
    return capacity


def write_capacity(capacity: Capacity, out: Path) -> Path:
    path = out / CAPACITY_FILE
    path.write_text(json.dumps({"kind": "capacity", "capacity": capacity.row()}, indent=1),
                    encoding="utf-8")
    return path
