"""The prefill a step may carry, in two latency classes. Short prompts (at most
long_prefill_tokens left to compute) are the interactive class: a step gives them its prefill
before any long prompt's chunk, so a chat prompt's first token never waits behind a long
prefill. Long prefills are the bulk class: their chunks take what the short prompts leave, a
step carrying one is held to long_prefill_step_ms by the learned step cost whether or not
streams decode (a short prompt arriving mid-step waits at most that long), and while they are
behind their guaranteed share of the prefill time per second (LongPrefillShare) they go first
instead, so they always finish. Under the ITL target a step that carries decodes takes only the
prefill the step cost says fits (PrefillTime); limit_for says whom it holds back. With
long_prefill_alone, long prefills leave the decodes' steps for prefill steps of their own.
PrefillPolicy makes every one of these decisions; the scheduler's two passes ask it. Pure
Python, no torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokstream.config import SchedulerConfig
from tokstream.engine.block_manager import BlockManager
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.output import ScheduledWork
from tokstream.engine.scheduler.step_cost import (MIN_PREFILL_TOKEN_S, StepCostModel,
                                                  attended_tokens)
from tokstream.engine.scheduler.step_draft import PrefillTime, StepDraft

SHARE_WINDOW_S = 1.0
"""The long prefills' share of prefill time is counted over about this many seconds (an
exponential decay with this time constant): a guarantee per second, not per step."""


def is_prefilling(request: Request) -> bool:
    """More than the newest token left to compute: the request's next work is a prompt chunk
    (a decode computes only its newest token)."""
    return request.num_tokens - request.num_computed_tokens > 1


class PrefillPolicy:
    """Whose prefill a step carries and how much of it: chunk sizes, the two latency classes,
    the ITL target's allowance and long prefills' steps of their own."""

    def __init__(self, config: SchedulerConfig, step_cost: StepCostModel,
                 blocks: BlockManager):
        self.config = config
        """Read live: a change shows at the next step."""
        self.step_cost = step_cost
        """Fitted from every step the engine reports (Scheduler.observe_step), target on or
        off."""
        self.blocks = blocks
        """Asked how much of a waiting request's prompt the prefix cache holds (is_long)."""
        self.long_share = LongPrefillShare()
        """The prefill time long and short prompts got lately: long prefills behind their
        share go before short prompts."""
        self.long_prompts: set[str] = set()
        """Requests whose prefill was long when admitted (is_long_prefill after their cached
        prefix): their chunks stay in the long class to the end of the prefill, whose last
        tokens, deep in the prompt, cost the most."""
        self.long_first = False
        """The latest step gave long prefills' chunks before short prompts (they were owed
        their share)."""
        self.last_step_alone = False
        """The latest step was a prefill step between decode steps (long_prefill_alone): the
        next one decodes."""

    @property
    def steps_apart(self) -> bool:
        """Long prefills run in prefill steps of their own while streams decode (and never in
        the decodes' steps): long_prefill_alone, under an ITL target, chunked."""
        config = self.config
        return config.long_prefill_alone and bool(config.itl_target_ms) and config.chunked_prefill

    @property
    def long_step_ms(self) -> float:
        """What a step carrying a long prefill's chunk may take while streams decode:
        long_prefill_step_ms, at most the ITL target (0: the target is off)."""
        config = self.config
        return min(config.itl_target_ms, config.long_prefill_step_ms or config.itl_target_ms)

    def is_long(self, request: Request) -> bool:
        """request's prefill is in the long class: long when it was admitted, or waiting with
        a long prefill ahead of it beyond what the prefix cache holds (a request behind a
        cached 2,000-token system prompt is short)."""
        if request.status == RequestStatus.RUNNING:
            return request.request_id in self.long_prompts and is_prefilling(request)
        return self.is_long_prefill(request, self.blocks.cached_prefix_tokens(request))

    def is_long_prefill(self, request: Request, cached_tokens: int = 0) -> bool:
        """More than long_prefill_tokens left to compute (cached_tokens: a waiting request's
        prefix the cache holds, which it will not compute)."""
        return (request.num_tokens - request.num_computed_tokens - cached_tokens
                > self.config.long_prefill_tokens)

    def admitted(self, request: Request, long: bool) -> None:
        """request started running, its prefill in the long class or not, to its end."""
        if long:
            self.long_prompts.add(request.request_id)
        else:
            self.long_prompts.discard(request.request_id)

    def forget(self, request_id: str) -> None:
        """request_id ended."""
        self.long_prompts.discard(request_id)

    def open_step(self, running: list[Request], waiting: Iterable[Request],
                  suspect_after_failures: int) -> StepDraft:
        """A new step: its token budget, what of it long prefills may take, whether it is a
        prefill step between decode steps; and whether long prefills go first in it."""
        budget = self.config.max_num_batched_tokens
        step = StepDraft(budget, self._long_allowance(budget, len(running), waiting),
                         suspect_after_failures)
        self.long_first = self.long_share.owed(self.config)
        step.alone_limit_s = self._alone_limit(running, waiting)
        return step

    def allow_prefill(self, step: StepDraft) -> None:
        """Set the step's prefill allowance under the ITL target once its decodes are in;
        None (the budget alone limits) with the target off, chunking off, or no step
        measured yet."""
        config, cost = self.config, self.step_cost
        target_s = config.itl_target_ms / 1000
        if not (target_s and config.chunked_prefill and cost.num_observations):
            step.prefill_time = None
        elif step.alone_limit_s is not None:
            step.prefill_time = PrefillTime(cost, cost.decode_seconds(0, 0), step.alone_limit_s,
                                            step.alone_limit_s, alone=True)
        else:
            decodes = step.decodes
            decode_s = cost.decode_seconds(
                len(decodes), sum(attended_tokens(w.start, w.num_tokens) for w in decodes))
            floor_s = decode_s + target_s * config.itl_min_prefill_share if decodes else 0.0
            # With nothing decoding only a short prompt's arrival waits on the step: the target.
            long_s = self.long_step_ms / 1000 if decodes else target_s
            step.prefill_time = PrefillTime(cost, decode_s,
                                            max(target_s, floor_s) if decodes else None,
                                            max(long_s, floor_s), len(decodes))

    def num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens of request to compute this step: one for a decode, else a prefill chunk."""
        remaining = request.num_tokens - request.num_computed_tokens
        if not self.config.chunked_prefill:
            return remaining
        return min(remaining, budget, self.config.max_prefill_chunk or budget)

    def chunk_tokens(self, step: StepDraft, request: Request, wanted: int, long: bool) -> int:
        """Tokens of request's next prefill chunk, at most wanted, that keep the step within
        the time limit_for gives it (0: none this step). long: request is in the long class."""
        limit_s = self.limit_for(request, step.prefill_time, step.decodes, long)
        if limit_s is None:
            return wanted
        return step.prefill_time.tokens(request.num_computed_tokens, wanted, limit_s)

    def limit_for(self, request: Request, prefill_time: PrefillTime | None,
                  decodes: list[ScheduledWork], long: bool) -> float | None:
        """The step time request's chunk must keep within (None: the budget alone limits it).
        A long prefill always: its chunks would otherwise fill step after step, holding every
        stream decoding beside it and every short prompt arriving during one (measured,
        long-prompt-flood on SmolLM2: chat ITL p99 7 s behind 8k-token prompts). A short
        prompt for streams whose first token was out before it arrived: streams that arrived
        with it (a burst of prompts) or after it are behind it, first come first served, as a
        burst's prompts all going in first gives every one of them its first token soonest."""
        if prefill_time is None:
            return None
        if long:
            return prefill_time.long_limit_s
        if prefill_time.alone and not request.recovering:
            return prefill_time.short_limit_s
        if request.recovering or prefill_time.short_limit_s is None:
            # A failure's recomputation: every stream it stalled, those decoding again
            # included, is better off with it done at once than spread thin over the steps of
            # a target the decodes alone may pass (measured, kill-engine at --tp 3 on 2 cores:
            # a 558-token prompt's re-prefill took 16 steps of 32 tokens, its first token 9 s
            # after the kill).
            return None
        if not any(w.request.first_token_at is not None
                   and w.request.first_token_at < request.arrival for w in decodes):
            return None
        return prefill_time.short_limit_s

    def close_step(self, step: StepDraft, clock: Callable[[], float]) -> None:
        """The step is built: count its predicted prefill seconds per class (for long_share;
        clock() is read only if it carries prefill)."""
        self.last_step_alone = step.alone_limit_s is not None
        long_s = short_s = 0.0
        for work in step.prefills:
            # Tokens at the least a token may cost, before the fit knows better.
            seconds = max(self.step_cost.prefill_seconds(work.start, work.num_tokens),
                          MIN_PREFILL_TOKEN_S * work.num_tokens)
            if self.is_long(work.request):
                long_s += seconds
            else:
                short_s += seconds
        if long_s or short_s:
            self.long_share.count(clock(), long_s, short_s)

    def _long_allowance(self, budget: int, num_running: int, waiting: Iterable[Request]) -> int:
        """Tokens long prefills may take this step: a share of the budget while a shorter
        prompt waits and could start, else no limit."""
        config = self.config
        share = config.long_prefill_share
        if (share < 1 and config.chunked_prefill
                and num_running < config.max_num_seqs
                and any(not self.is_long(r) for r in waiting)):
            return max(1, int(budget * share))
        return sys.maxsize

    def prefill_step_follows(self, running: list[Request], waiting: Iterable[Request]) -> bool:
        """This step decodes between two prefill steps (the latest was one, and a long prefill
        is still pending): short prompts wait for the next one, where they go before the long
        chunks, rather than lengthen this step, since a stream's gap is this step and the
        prefill step together (measured, long-prompt-flood at 3.1 req/s on SmolLM2: a chat
        prompt's ~300 tokens in a decode step made it 90-130 ms, and that gap up to 200 ms
        where long_prefill_step_ms is 60)."""
        return self.last_step_alone and self._long_pending(running, waiting)

    def _long_pending(self, running: list[Request], waiting: Iterable[Request]) -> bool:
        return any(self.is_long(r) for r in running) or any(self.is_long(r) for r in waiting)

    def _alone_limit(self, running: list[Request], waiting: Iterable[Request]) -> float | None:
        """The predicted seconds this step may take as a prefill step between decode steps
        (long_prefill_alone: streams decode, a long prefill is pending, and the latest step
        decoded); None: an ordinary step. Its decode neighbour and it together keep within
        long_step_ms, and it gets at least itl_min_prefill_share of the ITL target, as a chunk
        sharing a step does, so long prompts keep their pace however long the decode steps
        are."""
        if self.last_step_alone or not self.steps_apart or not self.step_cost.num_observations:
            return None
        decoding = [r for r in running if not is_prefilling(r)]
        if not (decoding and self._long_pending(running, waiting)):
            return None
        target_s = self.config.itl_target_ms / 1000
        decode_s = self.step_cost.decode_seconds(len(decoding),
                                                 sum(r.num_tokens for r in decoding))
        return max(self.long_step_ms / 1000 - decode_s,
                   target_s * self.config.itl_min_prefill_share)


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
