"""Where an engine core's start goes, phase by phase: what a restart after a core death costs.

Every phase is measured inside the processes concerned with time.monotonic(), which on Linux
is one clock for every process on the machine, so a phase may start in one process and end
in another (the gateway's spawn call -> the core's first line).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StartTimes:
    """Seconds per phase of one engine core start, in the order they happen (core -> gateway,
    in the core's Ready message)."""

    spawn_s: float
    """The gateway's process start -> the core's first line: a new interpreter, the pipe."""
    imports_s: float
    """The core's own imports (scheduler, tokenizer libraries; no torch)."""
    model_s: float
    """Resolving the model and building its tokenizer, before any rank exists."""
    ranks_start_s: float
    """Rank processes spawned -> each is loading: interpreter, torch and worker imports (the
    slowest rank's share of the group's wait that its own load does not explain)."""
    ranks_load_s: float
    """The slowest rank's own load: weights from the cache, model build, kernel probes, KV
    pool, the group's rendezvous."""
    rest_s: float
    """Everything after the group was ready (block manager, scheduler, a spare group's
    spawn) until the core reported ready."""
    total_s: float

    def as_dict(self) -> dict[str, float]:
        return {key: round(value, 3) for key, value in asdict(self).items()}
