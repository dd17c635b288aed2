"""The step Scheduler.schedule() is building: the work given so far and what is left of the
step's limits (tokens, long prefills' tokens, predicted seconds, one suspect), which both of
its passes (running requests, then admissions) read and spend. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.engine.request import Request
from tokstream.engine.scheduler.output import ScheduledWork, SchedulerOutput
from tokstream.engine.scheduler.step_cost import StepCostModel


@dataclass
class PrefillTime:
    """The step's prefill under the ITL target, in predicted seconds (prefill_policy.py)."""

    cost: StepCostModel
    step_s: float
    """Predicted seconds of the step so far: its decodes (or its fixed cost), chunks given."""
    short_limit_s: float | None
    """What a step whose short prompts are held may take in all (None: nothing decodes, so
    short prompts are limited by the token budget alone)."""
    long_limit_s: float
    """What a step that carries a long prefill's chunk may take in all."""
    num_decodes: int = 0
    """The step's decodes, which cost more in a step that carries prefill."""
    alone: bool = False
    """A prefill step between decode steps: every chunk in it is held to long_limit_s."""
    granted: int = 0
    """Prefill tokens given so far this step."""

    def tokens(self, start: int, wanted: int, limit_s: float) -> int:
        """Tokens of a chunk from position start that keep the step within limit_s (the
        first chunk gets at least one, so a prompt progresses every step however far the
        decodes alone are over)."""
        fits = self.cost.prefill_tokens_within(limit_s - self.step_s - self._step_cost(), start)
        return min(wanted, fits if self.granted else max(fits, 1))

    def take(self, start: int, num_tokens: int) -> None:
        self.step_s += self.cost.prefill_seconds(start, num_tokens) + self._step_cost()
        self.granted += num_tokens

    def _step_cost(self) -> float:
        """The step's once-only cost of carrying prefill, until the first chunk has paid it."""
        return 0.0 if self.granted else self.cost.prefill_switch_seconds(self.num_decodes)


@dataclass
class StepDraft:
    budget: int
    """Tokens the step may still take."""
    long_left: int
    """Tokens long prefills may still take (sys.maxsize: no limit)."""
    suspect_after_failures: int = 0
    """Requests in flight at this many failed steps in a row (0: off) are suspects of breaking
    the replica (Scheduler.suspect_after_failures): the step carries at most one."""
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    """The step's preemptions, requests ended and block copies so far; its work comes last
    (done)."""
    decodes: list[ScheduledWork] = field(default_factory=list)
    """Running requests' next tokens, with drafts or not."""
    prefills: list[ScheduledWork] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    """Running requests given work: preemption takes its victims from the others."""
    suspect_taken: bool = False
    """The step carries a suspect: it takes no other."""
    background_room: int | None = None
    """Background requests the step may still take (SchedulerConfig.background_rows_when_busy,
    while an interactive request runs); None: any."""
    alone_limit_s: float | None = None
    """A prefill step between decode steps (SchedulerConfig.long_prefill_alone): no decodes,
    and its prefill held to this many predicted seconds in all; None: an ordinary step."""
    prefill_time: PrefillTime | None = None
    """The step's prefill allowance under the ITL target, set once its decodes are in
    (PrefillPolicy.allow_prefill); None: the token budget alone limits its prefill."""

    def is_suspect(self, request: Request) -> bool:
        return 0 < self.suspect_after_failures <= request.num_failures

    def may_take(self, request: Request) -> bool:
        """False when request is a suspect and the step carries one already, or a background
        request past the step's room for them."""
        return not (self.suspect_taken and self.is_suspect(request)) \
            and not (request.background and self.background_room == 0)

    def takes(self, request: Request) -> bool:
        """may_take, and a suspect or a background request taken is counted."""
        if not self.may_take(request):
            return False
        if request.background and self.background_room is not None:
            self.background_room -= 1
        if not self.is_suspect(request):
            return True
        if self.suspect_taken:
            return False
        self.suspect_taken = True
        return True

    def take_long(self, num_tokens: int) -> int:
        """A long prefill's chunk of num_tokens, cut to what long prefills may still take this
        step, and spent from that."""
        num_tokens = min(num_tokens, self.long_left)
        self.long_left -= num_tokens
        return num_tokens

    def took_prefill(self, start: int, num_tokens: int) -> None:
        """A prefill chunk from start went in: its predicted seconds count against the rest."""
        if self.prefill_time is not None:
            self.prefill_time.take(start, num_tokens)

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
