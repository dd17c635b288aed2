"""Where each engine step's time goes, one JSON line a step, for diagnostics only
(TOKSTREAM_STEP_TIMES=path; bench/served_step.py reads it).

A served step is the core's scheduling, then the ranks' round trip (the plan pickled down the
pipes, the forward pass and sampling, the result back), then emitting the deltas
(detokenising); rank 0 times its own part of the round trip. The clock is time.monotonic(),
which every process on the host shares, so a reader can place the lines beside its own
timings. No torch."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TextIO

from tokstream import envs


@dataclass
class StepTimes:
    step_id: int
    tokens: int
    """Tokens computed (prefill chunks, decodes, drafts verified)."""
    rows: int
    """Requests in the step."""
    decodes: int
    """Requests in it that decode (one token each)."""
    drafts: int
    """Draft tokens verified beside those decodes (speculation); the rest of `tokens` is
    prefill."""
    start: float
    """time.monotonic() as the core began the step."""
    schedule_s: float
    ranks_s: float
    """The round trip to the ranks, as the core saw it."""
    rank0_s: float
    """Rank 0's own time inside it (StepResult.execute_s)."""
    emit_s: float


class StepTimesLog:
    """The core's end: opened once, a line written (and flushed) a step."""

    def __init__(self, out: TextIO):
        self._out = out

    @classmethod
    def from_env(cls) -> "StepTimesLog | None":
        path = envs.STEP_TIMES.get()
        return cls(open(path, "a", buffering=1)) if path else None

    def write(self, times: StepTimes) -> None:
        self._out.write(json.dumps(asdict(times)) + "\n")

    def close(self) -> None:
        self._out.close()


def read(path: str) -> list[StepTimes]:
    """Every step written to path (a line cut short by a killed core is skipped)."""
    steps = []
    with open(path) as lines:
        for line in lines:
            try:
                steps.append(StepTimes(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return steps
