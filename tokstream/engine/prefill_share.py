"""The prefill a step may carry beside the streams already decoding: under the ITL target, what
the learned step cost says fits (PrefillTime); which prompts the target holds back (limit_for);
and the share long prefills may take while a shorter prompt waits (long_prefill_allowance,
time_share). Pure Python, no torch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from tokstream.config import SchedulerConfig
from tokstream.engine.request import Request
from tokstream.engine.scheduled import ScheduledWork
from tokstream.engine.step_cost import StepCostModel, attended_tokens


@dataclass
class PrefillTime:
    """The prefill a step may still take under the ITL target, in predicted seconds."""

    cost: StepCostModel
    seconds_left: float
    num_decodes: int = 0
    """The step's decodes, which cost more in a step that carries prefill."""
    granted: int = 0
    """Prefill tokens given so far this step."""

    def tokens(self, start: int, wanted: int, share: float = 1.0) -> int:
        """Tokens of a chunk from position start that fit in share of the time left (the
        first chunk gets at least one, so a prompt progresses every step however far the
        decodes alone are over)."""
        fits = self.cost.prefill_tokens_within(
            (self.seconds_left - self._step_cost()) * share, start)
        return min(wanted, fits if self.granted else max(fits, 1))

    def take(self, start: int, num_tokens: int) -> None:
        self.seconds_left -= self.cost.prefill_seconds(start, num_tokens) + self._step_cost()
        self.granted += num_tokens

    def _step_cost(self) -> float:
        """The step's once-only cost of carrying prefill, until the first chunk has paid it."""
        return 0.0 if self.granted else self.cost.prefill_switch_seconds(self.num_decodes)


def prefill_allowance(config: SchedulerConfig, step_cost: StepCostModel,
                      decodes: list[ScheduledWork]) -> PrefillTime | None:
    """The step's prefill allowance under the ITL target; None (the budget alone limits)
    with the target off, chunking off, nothing decoding, or no step measured yet."""
    target_s = config.itl_target_ms / 1000
    if not (target_s and config.chunked_prefill and decodes
            and step_cost.num_observations):
        return None
    decode_s = step_cost.decode_seconds(
        len(decodes), sum(attended_tokens(w.start, w.num_tokens) for w in decodes))
    floor_s = target_s * config.itl_min_prefill_share
    return PrefillTime(step_cost, max(target_s - decode_s, floor_s), len(decodes))


def limit_for(config: SchedulerConfig, request: Request, prefill_time: PrefillTime | None,
               decodes: list[ScheduledWork]) -> PrefillTime | None:
    """prefill_time where the ITL target holds request's prefill back: for streams whose
    first token was out before it arrived, and always for a long prompt. Streams that
    arrived with a short prompt (a burst of prompts) or after it are behind it, first come
    first served: their next tokens wait for its prefill, as a burst's prompts all going
    in first gives every one of them its first token soonest. A long prompt's chunks would
    hold every stream decoding beside it for the many steps of its prefill (measured,
    long-prompt-flood on SmolLM2: chat ITL p99 7 s behind 8k-token prompts)."""
    if prefill_time is None:
        return None
    if len(request.prompt_token_ids) > config.long_prefill_tokens and decodes:
        return prefill_time
    if request.recovering:
        # A failure's recomputation: every stream it stalled, those decoding again included,
        # is better off with it done at once than spread thin over the steps of a target
        # the decodes alone may pass (measured, kill-engine at --tp 3 on 2 cores: a 558-token
        # prompt's re-prefill took 16 steps of 32 tokens, its first token 9 s after the kill).
        # A long prompt stays held: its re-prefill would hold the resumed streams as long.
        return None
    if not any(w.request.first_token_at is not None
               and w.request.first_token_at < request.arrival for w in decodes):
        return None
    return prefill_time



def is_long_prefill(config: SchedulerConfig, request: Request) -> bool:
    return (request.num_tokens - request.num_computed_tokens
            > config.long_prefill_tokens)


def time_share(config: SchedulerConfig, request: Request, long_left: int) -> float:
    """The share of the step's prefill time request's chunk may take: long prefills take
    long_prefill_share of it while a shorter prompt waits (as of the token budget), or a
    long prompt mid-prefill would take all of it step after step, and a chat prompt
    behind it would wait for its whole prefill."""
    if long_left != sys.maxsize and is_long_prefill(config, request):
        return config.long_prefill_share
    return 1.0


def long_prefill_allowance(config: SchedulerConfig, budget: int, num_running: int,
                           waiting: Iterable[Request]) -> int:
    """Tokens long prefills may take this step: a share of the budget while a shorter
    prompt waits and could start, else no limit."""
    share = config.long_prefill_share
    if (share < 1 and config.chunked_prefill
            and num_running < config.max_num_seqs
            and any(not is_long_prefill(config, r) for r in waiting)):
        return max(1, int(budget * share))
    return sys.maxsize
