"""The prefill a step may carry, in two latency classes. Short prompts (at most
long_prefill_tokens left to compute) are the interactive class: a step gives them its prefill
before any long prompt's chunk, so a chat prompt's first token never waits behind a long
prefill. Long prefills are the bulk class: their chunks take what the short prompts leave, a
step carrying one is held to long_prefill_step_ms by the learned step cost whether or not
streams decode (a short prompt arriving mid-step waits at most that long), and while they are
behind their guaranteed share of the prefill time per second (LongPrefillShare) they go first
instead, so they always finish. Under the ITL target a step that carries decodes takes only the
prefill the step cost says fits (PrefillTime); limit_for says whom it holds back. Pure Python,
no torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokstream.config import SchedulerConfig
from tokstream.engine.request import Request
from tokstream.engine.scheduler.output import ScheduledWork
from tokstream.engine.scheduler.step_cost import StepCostModel, attended_tokens

SHARE_WINDOW_S = 1.0
"""The long prefills' share of prefill time is counted over about this many seconds (an
exponential decay with this time constant): a guarantee per second, not per step."""


@dataclass
class PrefillTime:
    """The step's prefill under the ITL target, in predicted seconds."""

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


def prefill_allowance(config: SchedulerConfig, step_cost: StepCostModel,
                      decodes: list[ScheduledWork],
                      alone_limit_s: float | None = None) -> PrefillTime | None:
    """The step's prefill allowance under the ITL target; None (the budget alone limits)
    with the target off, chunking off, or no step measured yet. alone_limit_s: the step is
    a prefill step between decode steps, held to that many seconds."""
    target_s = config.itl_target_ms / 1000
    if not (target_s and config.chunked_prefill and step_cost.num_observations):
        return None
    if alone_limit_s is not None:
        return PrefillTime(step_cost, step_cost.decode_seconds(0, 0), alone_limit_s,
                           alone_limit_s, alone=True)
    decode_s = step_cost.decode_seconds(
        len(decodes), sum(attended_tokens(w.start, w.num_tokens) for w in decodes))
    floor_s = decode_s + target_s * config.itl_min_prefill_share if decodes else 0.0
    # With nothing decoding only a short prompt's arrival waits on the step: the target.
    long_s = min(target_s, long_step_seconds(config)) if decodes else target_s
    return PrefillTime(step_cost, decode_s, max(target_s, floor_s) if decodes else None,
                       max(long_s, floor_s), len(decodes))


def long_step_seconds(config: SchedulerConfig) -> float:
    return (config.long_prefill_step_ms or config.itl_target_ms) / 1000


def prefill_steps_apart(config: SchedulerConfig) -> bool:
    """Long prefills run in prefill steps of their own while streams decode (and never in
    the decodes' steps): long_prefill_alone, under an ITL target, chunked."""
    return config.long_prefill_alone and bool(config.itl_target_ms) and config.chunked_prefill


def alone_step_seconds(config: SchedulerConfig, step_cost: StepCostModel,
                       decoding: list[Request]) -> float:
    """What a prefill step between decode steps may take: long_prefill_step_ms less the
    predicted decode step of the requests decoding (a stream's gap is the two steps), and at
    least itl_min_prefill_share of the ITL target, as a chunk sharing a step gets, so long
    prompts keep their pace however long the decode steps are."""
    target_s = config.itl_target_ms / 1000
    long_s = min(target_s, long_step_seconds(config))
    decode_s = step_cost.decode_seconds(len(decoding), sum(r.num_tokens for r in decoding))
    return max(long_s - decode_s, target_s * config.itl_min_prefill_share)


def limit_for(config: SchedulerConfig, request: Request, prefill_time: PrefillTime | None,
              decodes: list[ScheduledWork], long: bool) -> float | None:
    """The step time request's chunk must keep within (None: the budget alone limits it).
    A long prefill always: its chunks would otherwise fill step after step, holding every
    stream decoding beside it and every short prompt arriving during one (measured,
    long-prompt-flood on SmolLM2: chat ITL p99 7 s behind 8k-token prompts). A short prompt
    for streams whose first token was out before it arrived: streams that arrived with it
    (a burst of prompts) or after it are behind it, first come first served, as a burst's
    prompts all going in first gives every one of them its first token soonest. long: request
    is in the long class (Scheduler.is_long)."""
    if prefill_time is None:
        return None
    if long:
        return prefill_time.long_limit_s
    if prefill_time.alone and not request.recovering:
        return prefill_time.short_limit_s
    if request.recovering or prefill_time.short_limit_s is None:
        # A failure's recomputation: every stream it stalled, those decoding again included,
        # is better off with it done at once than spread thin over the steps of a target
        # the decodes alone may pass (measured, kill-engine at --tp 3 on 2 cores: a 558-token
        # prompt's re-prefill took 16 steps of 32 tokens, its first token 9 s after the kill).
        return None
    if not any(w.request.first_token_at is not None
               and w.request.first_token_at < request.arrival for w in decodes):
        return None
    return prefill_time.short_limit_s


def is_long_prefill(config: SchedulerConfig, request: Request, cached_tokens: int = 0) -> bool:
    """More than long_prefill_tokens left to compute (cached_tokens: a waiting request's
    prefix the cache holds, which it will not compute)."""
    return (request.num_tokens - request.num_computed_tokens - cached_tokens
            > config.long_prefill_tokens)


def long_prefill_allowance(config: SchedulerConfig, budget: int, num_running: int,
                           waiting: Iterable[Request],
                           is_long: Callable[[Request], bool]) -> int:
    """Tokens long prefills may take this step: a share of the budget while a shorter
    prompt waits and could start, else no limit."""
    share = config.long_prefill_share
    if (share < 1 and config.chunked_prefill
            and num_running < config.max_num_seqs
            and any(not is_long(r) for r in waiting)):
        return max(1, int(budget * share))
    return sys.maxsize


@dataclass
class LongPrefillShare:
    """The prefill time long and short prompts got lately (predicted seconds, decayed with
    SHARE_WINDOW_S), which says whether long prefills are owed their share."""

    long_s: float = 0.0
    short_s: float = 0.0
    at: float | None = None
    """The clock when last counted."""

    def count(self, now: float, long_s: float, short_s: float) -> None:
        if self.at is not None:
            keep = math.exp(-max(0.0, now - self.at) / SHARE_WINDOW_S)
            self.long_s, self.short_s = self.long_s * keep, self.short_s * keep
        self.at = now
        self.long_s += long_s
        self.short_s += short_s

    @property
    def share(self) -> float | None:
        """Long prefills' share of the prefill time lately (None: no prefill lately)."""
        total = self.long_s + self.short_s
        return self.long_s / total if total > 1e-9 else None

    def owed(self, config: SchedulerConfig) -> bool:
        """Long prefills are behind long_prefill_share of the prefill time: they go before
        the short prompts this step (always at share 1, or without chunking: first come,
        first served). With no prefill lately they are not behind."""
        if config.long_prefill_share >= 1 or not config.chunked_prefill:
            return True
        share = self.share
        return share is not None and share < config.long_prefill_share
