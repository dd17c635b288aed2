"""How many tokens a request drafts this step under `--speculative auto` (issue 34 item 4):
as many as pay for their verification, judged from the fitted step cost and the request's
recent acceptance. Pure Python, no torch.

Acceptance. For each draft position j of a request, p_j estimates the chance that draft j is
accepted given drafts 1..j-1 were (a position past the first rejection is not observed): an
exponentially weighted mean of its outcomes (DECAY per observation of that position), started
from PRIOR_ACCEPTANCE as PRIOR_WEIGHT observations that fade like any others. Short memory:
an answer quotes, then stops, then quotes again.

Cost. A verify chunk's positions are decode rows (scheduled.step_shape; the ranks run them in
the decode stack), so draft j of a request whose last token sits at position s costs
b + d (s + 1 + j) (StepCostModel.per_decode_s, one row; per_attended_token_s, the keys it
attends).

The rule. A step that takes T seconds for N tokens, given one more row of Δt seconds that
yields y tokens on average, serves (N + y) / (T + Δt) > N / T exactly when y / Δt > N / T. So
draft j pays when p_1 ... p_j > Δt_j N / T, with N / T the rate of the batch's decodes as the
fit predicts them without drafts (N decodes in T = decode_seconds). The product only falls and
Δt_j only grows with j, so k is the number of leading positions that pay.

Before the fit has COLD_START_STEPS steps, k is COLD_START_K. A request the rule declined
`probe_after` steps in a row drafts one token (a probe), so that a match that returns (an
answer starts quoting) is seen: its outcome updates p_1 like any draft's. probe_after doubles
from FIRST_PROBE_AFTER to LAST_PROBE_AFTER with each probe and goes back once the rule drafts
again, so a request the rule keeps declining spends at most one row in 64 steps on probes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.engine.scheduler.step_cost import MIN_PREFILL_TOKEN_S, StepCostModel

PRIOR_ACCEPTANCE = 0.5
"""A new request's acceptance at every position: prompt lookup's ranges from ~0.1 (free
chat) to ~0.8 (editing, quoting), so neither end; at it a first draft pays while a row costs
under half a token's share of the step (it does at small batches)."""
PRIOR_WEIGHT = 2.0
"""The prior counts as this many observations: two rejections bring p_1 from 0.5 to 0.2."""
DECAY = 0.8
"""Weight an outcome keeps at each later one of its position (a memory of ~5 verifications)."""
COLD_START_STEPS = 16
"""Steps the cost fit must have seen before it decides (twice its robust_after)."""
COLD_START_K = 2
"""Drafts per step before that: cheap if they fail, and they teach the fit verify rows."""
FIRST_PROBE_AFTER = 8
LAST_PROBE_AFTER = 64


@dataclass(frozen=True)
class StepPrice:
    """What the step being scheduled gets for its time, and what a drafted row costs in it,
    as the step cost fit has them."""

    fitted: bool
    """The fit has seen enough steps to be trusted (COLD_START_STEPS) and predicts a cost."""
    tokens_per_second: float
    """N / T: the step's decodes over the fit's time for them, drafts aside."""
    row_s: float
    """b: a drafted position as a decode row of the fit (at least MIN_PREFILL_TOKEN_S)."""
    attended_pair_s: float
    """d: each key a drafted position attends."""

    @classmethod
    def of(cls, step_cost: StepCostModel, num_decodes: int, attended: int) -> StepPrice:
        """The price for a step of num_decodes decodes attending attended keys in all."""
        seconds = step_cost.decode_seconds(num_decodes, attended)
        fitted = step_cost.num_observations >= COLD_START_STEPS and seconds > 0
        return cls(fitted, num_decodes / seconds if fitted else 0.0,
                   max(step_cost.per_decode_s, MIN_PREFILL_TOKEN_S),
                   step_cost.per_attended_token_s)

    def row_seconds(self, start: int, position: int) -> float:
        """The cost of draft `position` (1 is the first) after a last token at start."""
        return self.row_s + self.attended_pair_s * (start + 1 + position)


@dataclass
class Acceptance:
    """One request's recent acceptance per draft position, and when it next probes."""

    accepted: list[float]
    """Exponentially weighted accepted outcomes per position (0 first), the prior's included."""
    observed: list[float]
    """Exponentially weighted observations per position, the prior's included."""
    declined: int = 0
    """Steps in a row the rule drafted nothing."""
    probe_after: int = FIRST_PROBE_AFTER
    probing: bool = False
    """The latest choice was a probe (its verification doubles probe_after)."""

    @classmethod
    def new(cls, num_positions: int) -> Acceptance:
        return cls([PRIOR_ACCEPTANCE * PRIOR_WEIGHT] * num_positions,
                   [PRIOR_WEIGHT] * num_positions)

    def rate(self, position: int) -> float:
        """p_position: draft `position` (1 first) accepted given those before it were."""
        return self.accepted[position - 1] / self.observed[position - 1]

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verification: positions 1..num_accepted accepted, the next (if drafted)
        rejected, those after it unseen."""
        for index in range(min(num_drafted, num_accepted + 1, len(self.observed))):
            self.accepted[index] = (DECAY * self.accepted[index]
                                    + (1.0 if index < num_accepted else 0.0))
            self.observed[index] = DECAY * self.observed[index] + 1.0
        if self.probing:
            self.probe_after = min(2 * self.probe_after, LAST_PROBE_AFTER)
        self.probing = False
        self.declined = 0


def paying_length(acceptance: Acceptance, price: StepPrice, start: int, most: int) -> int:
    """The rule (module docstring): how many leading draft positions, at most `most`, expect
    more tokens than their time buys at the step's rate."""
    reach = 1.0  # p_1 ... p_j: the chance draft j is reached and accepted
    for position in range(1, min(most, len(acceptance.observed)) + 1):
        reach *= acceptance.rate(position)
        if reach <= price.row_seconds(start, position) * price.tokens_per_second:
            return position - 1
    return min(most, len(acceptance.observed))


def choose_draft_length(acceptance: Acceptance, price: StepPrice | None, start: int,
                        most: int) -> int:
    """Tokens to draft this step: COLD_START_K before the fit is trusted, else the rule's
    choice, or a one-token probe after a run of declined steps."""
    if most <= 0:
        return 0
    if price is None or not price.fitted:
        return min(COLD_START_K, most)
    k = paying_length(acceptance, price, start, most)
    if k > 0:
        acceptance.declined, acceptance.probing = 0, False
        acceptance.probe_after = FIRST_PROBE_AFTER
        return k
    acceptance.declined += 1
    acceptance.probing = acceptance.declined >= acceptance.probe_after
    return 1 if acceptance.probing else 0


@dataclass
class DraftLengths:
    """Every live request's Acceptance, made at its first choice."""

    num_positions: int
    by_request: dict[str, Acceptance] = field(default_factory=dict)

    def choose(self, request_id: str, price: StepPrice | None, start: int, most: int) -> int:
        acceptance = self.by_request.get(request_id)
        if acceptance is None:
            acceptance = self.by_request[request_id] = Acceptance.new(self.num_positions)
        return choose_draft_length(acceptance, price, start, most)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        acceptance = self.by_request.get(request_id)
        if acceptance is not None:  # None: aborted while its step ran (already forgotten)
            acceptance.observe(num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        self.by_request.pop(request_id, None)
