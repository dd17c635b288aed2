"""The step Scheduler.schedule() is building: the work given so far and what is left of the
step's limits, which both of its passes (running requests, then admissions) read and spend.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.config import SchedulerConfig
from old_scheduler.prefill_share import PrefillTime, prefill_allowance
from tokstream.engine.scheduler.output import ScheduledWork, SchedulerOutput
from tokstream.engine.scheduler.step_cost import StepCostModel


@dataclass
class StepDraft:
    budget: int
    """Tokens the step may still take."""
    long_left: int
    """Tokens long prefills may still take (sys.maxsize: no limit)."""
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    """The step's preemptions, requests ended and block copies so far; its work comes last
    (done)."""
    decodes: list[ScheduledWork] = field(default_factory=list)
    """Running requests' next tokens, with drafts or not."""
    prefills: list[ScheduledWork] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    """Running requests given work: preemption takes its victims from the others."""
    suspect_taken: bool = False
    """The step carries a suspect (Scheduler.suspect_after_failures): it takes no other."""
    alone_limit_s: float | None = None
    """A prefill step between decode steps (SchedulerConfig.long_prefill_alone): no decodes,
    and its prefill held to this many predicted seconds in all; None: an ordinary step."""
    _prefill_time: PrefillTime | None = field(default=None, init=False)
    _prefill_time_known: bool = field(default=False, init=False)

    def prefill_time(self, config: SchedulerConfig,
                     step_cost: StepCostModel) -> PrefillTime | None:
        """The step's prefill allowance under the ITL target, set at its first prefill chunk:
        it needs the step's decodes, which go first."""
        if not self._prefill_time_known:
            self._prefill_time = prefill_allowance(config, step_cost, self.decodes,
                                                   self.alone_limit_s)
            self._prefill_time_known = True
        return self._prefill_time

    def spend(self, num_tokens: int) -> None:
        self.budget = max(0, self.budget - num_tokens)

    def done(self, forgotten_ids: list[str]) -> SchedulerOutput:
        """The finished step: decodes (one token) first, then decodes with drafts (their
        chunks are longer: the workers batch one-token chunks at the head of a step), then
        prefill chunks: those of running requests in running order, then those admitted, in
        admission order."""
        prefills = sorted(self.prefills, key=lambda w: (
            (1, 0, 0) if w.is_new else (0, w.request.priority, w.request.arrival)))
        decodes = sorted(self.decodes, key=lambda w: w.is_verify)  # stable: running order
        self.out.work = decodes + prefills
        self.out.forgotten_ids = forgotten_ids
        return self.out
