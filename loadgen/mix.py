"""Workload mixes: TOML files in profiles/mixes/ (`--mix NAME`) or anywhere (`--mix FILE`).

    kind = "mix"
    description = "..."

    [run]                         # defaults; command-line flags override them
    arrival = "closed"            # closed (users back to back) | poisson | bursty (open loop)
    users = 8                     # closed loop: concurrent users
    rate = 2.0                    # open loop: requests per second, or instead:
    capacity_fraction = 0.5       # open loop at this fraction of the server's measured capacity
    burstiness = 1.0              # bursty: gamma shape (< 1 burstier than Poisson)
    duration_s = 60               # stop issuing after this long (0 = no limit)
    requests = 0                  # stop after this many requests (0 = no limit)

    [tenants]                     # tenant -> share of requests (a tenant is a key in --keys)
    alice = 1

    [tenant_weights]              # tenant -> its fair-share weight on the server (default 1):
    alice = 2                     # the report's max-min fair shares are weighted by it

    [[class]]                     # a workload class; its requests are summarised together
    name = "chat"
    weight = 1.0                  # share of the main arrivals (0: only its bursts)
    prompt_tokens = [50, 400]     # exact input tokens: a number or [min, max]
    prompt_distribution = "uniform"   # or "log-uniform"
    output_tokens = [16, 128]     # a number, [min, max], or "max" (the rest of the context)
    shared_prefix_tokens = 0      # a system prompt of this many words common to the class
    burst_every_s = 0             # > 0: every this many seconds, burst_size requests at once
    burst_size = 0
    ignore_eos = true             # generate exactly output_tokens (as benchmarks do)
    temperature = 0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from tokstream.errors import UserInputError
from tokstream.toml_file import read_toml

MIX_DIR = Path(__file__).resolve().parents[1] / "profiles" / "mixes"
ARRIVALS = ("closed", "poisson", "bursty")
DISTRIBUTIONS = ("uniform", "log-uniform")


@dataclass
class WorkloadClass:
    name: str
    weight: float = 1.0
    prompt_tokens: tuple[int, int] = (128, 128)
    """Inclusive range of input tokens as users state them (before clamping to the context)."""
    prompt_distribution: str = "uniform"
    output_tokens: tuple[int, int] | None = (64, 64)
    """Inclusive range of max_tokens; None asks for the rest of the context."""
    shared_prefix_tokens: int = 0
    burst_every_s: float = 0.0
    burst_size: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0


@dataclass
class RunSettings:
    arrival: str = "closed"
    users: int = 8
    rate: float = 1.0
    """Open loop: requests per second (unless capacity_fraction is given)."""
    capacity_fraction: float | None = None
    """Open loop: the rate as this fraction of the server's measured capacity (requests/s of a
    closed loop at full concurrency), so one mix means the same load on any machine."""
    burstiness: float = 1.0
    duration_s: float = 60.0
    requests: int = 0


@dataclass
class Mix:
    name: str
    description: str
    classes: list[WorkloadClass]
    tenants: dict[str, float] = field(default_factory=lambda: {"default": 1.0})
    run: RunSettings = field(default_factory=RunSettings)
    tenant_weights: dict[str, float] | None = None
    """Tenant -> fair-share weight (as the server's tenants file gives it); None: all equal."""

    @property
    def main_classes(self) -> list[WorkloadClass]:
        return [c for c in self.classes if c.weight > 0]

    @property
    def burst_classes(self) -> list[WorkloadClass]:
        return [c for c in self.classes if c.burst_every_s > 0 and c.burst_size > 0]

    def without_bursts(self) -> "Mix":
        """The main arrivals alone: what a rate (and so a capacity) is measured in."""
        classes = [replace(c, burst_every_s=0.0, burst_size=0) for c in self.main_classes]
        return replace(self, classes=classes)


def available_mixes() -> list[str]:
    return sorted(p.stem for p in MIX_DIR.glob("*.toml"))


def load_mix(name_or_path: str) -> Mix:
    """NAME looks in profiles/mixes/; anything with a slash or a .toml suffix is a path."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" or "/" in name_or_path):
        path = MIX_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise UserInputError(f"mix {name_or_path!r} not found (available: "
                             f"{', '.join(available_mixes()) or 'none'})")
    data = read_toml(path, "mix")
    try:
        return parse_mix(data, path.stem)
    except UserInputError as error:
        raise UserInputError(f"mix {path}: {error}") from None


def parse_mix(data: dict, name: str) -> Mix:
    if data.get("kind") != "mix":
        raise UserInputError('not a workload mix (it needs kind = "mix")')
    unknown = set(data) - {"kind", "description", "run", "tenants", "tenant_weights", "class"}
    if unknown:
        raise UserInputError(f"unknown key(s) {', '.join(sorted(unknown))}")
    raw_classes = data.get("class")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise UserInputError("needs at least one [[class]]")
    classes = [_workload_class(c, n) for n, c in enumerate(raw_classes)]
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise UserInputError(f"class names repeat: {names}")
    if not any(c.weight > 0 for c in classes):
        raise UserInputError("no class has weight > 0 (the main arrivals need one)")
    tenants = data.get("tenants", {"default": 1.0})
    if not isinstance(tenants, dict) or not tenants or not all(
            _is_number(v) and v > 0 for v in tenants.values()):
        raise UserInputError("[tenants] maps each tenant name to a positive share")
    weights = data.get("tenant_weights")
    if weights is not None:
        if not isinstance(weights, dict) or not all(_is_number(v) and v > 0
                                                    for v in weights.values()):
            raise UserInputError("[tenant_weights] maps each tenant name to a positive weight")
        strangers = sorted(set(weights) - set(tenants))
        if strangers:
            raise UserInputError(f"tenant_weights: {', '.join(strangers)} not in [tenants]")
        weights = {str(t): float(weights.get(t, 1.0)) for t in tenants}
    return Mix(name, str(data.get("description", "")), classes,
               {str(k): float(v) for k, v in tenants.items()}, _run(data.get("run", {})),
               weights)


def _workload_class(raw, n: int) -> WorkloadClass:
    at = f"class.{n}"
    if not isinstance(raw, dict):
        raise UserInputError(f"{at}: must be a table")
    known = set(WorkloadClass.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise UserInputError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}")
    if not isinstance(raw.get("name"), str) or not raw["name"]:
        raise UserInputError(f"{at}.name: required")
    output = raw.get("output_tokens", 64)
    workload = WorkloadClass(
        name=raw["name"],
        weight=_number(raw, "weight", 1.0, at, minimum=0),
        prompt_tokens=_token_range(raw.get("prompt_tokens", 128), f"{at}.prompt_tokens"),
        prompt_distribution=raw.get("prompt_distribution", "uniform"),
        output_tokens=None if output == "max" else _token_range(output, f"{at}.output_tokens"),
        shared_prefix_tokens=int(_number(raw, "shared_prefix_tokens", 0, at, minimum=0)),
        burst_every_s=_number(raw, "burst_every_s", 0.0, at, minimum=0),
        burst_size=int(_number(raw, "burst_size", 0, at, minimum=0)),
        ignore_eos=bool(raw.get("ignore_eos", True)),
        temperature=_number(raw, "temperature", 0.0, at, minimum=0),
    )
    if workload.prompt_distribution not in DISTRIBUTIONS:
        raise UserInputError(f"{at}.prompt_distribution: one of {', '.join(DISTRIBUTIONS)}")
    if workload.shared_prefix_tokens >= workload.prompt_tokens[0]:
        raise UserInputError(f"{at}.shared_prefix_tokens: must be below the shortest prompt "
                             f"({workload.prompt_tokens[0]})")
    if workload.weight == 0 and not (workload.burst_every_s and workload.burst_size):
        raise UserInputError(f"{at}: weight 0 and no bursts: it would never send a request")
    return workload


def _run(raw) -> RunSettings:
    if not isinstance(raw, dict):
        raise UserInputError("[run] must be a table")
    unknown = set(raw) - set(RunSettings.__dataclass_fields__)
    if unknown:
        raise UserInputError(f"run: unknown key(s) {', '.join(sorted(unknown))}")
    settings = RunSettings(
        arrival=raw.get("arrival", "closed"),
        users=int(_number(raw, "users", 8, "run", minimum=1)),
        rate=_number(raw, "rate", 1.0, "run", minimum=0),
        capacity_fraction=None if "capacity_fraction" not in raw
        else _number(raw, "capacity_fraction", None, "run", minimum=0),
        burstiness=_number(raw, "burstiness", 1.0, "run", minimum=0),
        duration_s=_number(raw, "duration_s", 60.0, "run", minimum=0),
        requests=int(_number(raw, "requests", 0, "run", minimum=0)))
    if settings.arrival not in ARRIVALS:
        raise UserInputError(f"run.arrival: one of {', '.join(ARRIVALS)}")
    if settings.capacity_fraction is not None:
        if "rate" in raw:
            raise UserInputError("run: give rate or capacity_fraction, not both")
        if not settings.capacity_fraction > 0:
            raise UserInputError("run.capacity_fraction: must be > 0")
        if settings.arrival == "closed":
            raise UserInputError("run.capacity_fraction: needs an open-loop arrival "
                                 "(poisson or bursty); a closed loop is set by its users")
    return settings


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(raw: dict, key: str, default, at: str, minimum: float):
    value = raw.get(key, default)
    if not _is_number(value) or value < minimum:
        raise UserInputError(f"{at}.{key}: must be a number >= {minimum}, got {value!r}")
    return value


def _token_range(value, at: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and 1 <= value[0] <= value[1]):
        raise UserInputError(f"{at}: a positive whole number or [min, max], got {value!r}")
    return value[0], value[1]
