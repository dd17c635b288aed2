"""Continuous batching: every step is rebuilt from the running and waiting requests.

A step is a token budget filled with running requests first (decodes, and prompts part-way
through a chunked prefill), then new prompts while blocks, the budget and the sequence cap
allow (admission.py). With chunking off a prompt is taken whole, past the budget if need be.
Under an ITL target a step that carries decodes takes only the prefill its learned step cost
says fits under the target (at least a small floor, so waiting prompts progress;
prefill_share.py). When the pool runs dry mid-generation the lowest-priority, latest-arrived
running request is preempted: its blocks are freed and it is recomputed from prompt + output
later, or, in swap mode, its blocks are copied to host memory first and copied back on
re-admission (preemption.py). Either way its stream is unchanged. Both passes fill one
StepDraft (step_draft.py). With speculative decoding on, a decode may carry drafted tokens
verified in the same chunk; update() keeps those accepted and gives back the rest
(speculation.py). Pure Python, no torch.
"""

from __future__ import annotations

import time

from tokstream.config import SchedulerConfig
from old_scheduler.admission import admit_waiting, running_order  # noqa: F401 (re-export)
from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.draft_length import StepPrice
from tokstream.engine.scheduler.fairness import FairnessLedger
from old_scheduler.preemption import allocate_or_preempt, release_swap
from old_scheduler.prefill_share import (LongPrefillShare, alone_step_seconds,
                                            is_long_prefill, limit_for,
                                            long_prefill_allowance, prefill_steps_apart)
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.output import ScheduledWork, SchedulerOutput, step_shape
from tokstream.engine.speculation import Speculator
from tokstream.engine.scheduler.step_cost import MIN_PREFILL_TOKEN_S, StepCostModel
from old_scheduler.step_draft import StepDraft
from tokstream.engine.scheduler.waiting_queue import WaitingQueue


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), swap_space: SwapSpace | None = None,
                 suspect_after_failures: int = 0, speculator: Speculator | None = None):
        self.config = config
        self.speculator = speculator
        """Drafts for running decodes (speculative decoding); None: off."""
        self.suspect_after_failures = suspect_after_failures
        """Requests in flight at this many failed steps in a row (0: off) are suspects of
        breaking the replica: a step takes at most one, so the one that does is found alone
        and the others are not ended with it."""
        self.swap_space = swap_space
        """Host blocks for swap-mode preemption; None means recompute only."""
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.ledger = FairnessLedger()
        self.waiting = WaitingQueue(config.policy, self.ledger)
        self.running: list[Request] = []
        """Kept in (priority, arrival) order: a step visits decodes, then prefills, each in
        that order, and preempts from the end (lowest priority, latest arrival) the requests
        it has not yet given work."""
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swap_outs = 0
        """Of the preemptions, those that kept their KV in host memory."""
        self.step_cost = StepCostModel()
        """Fitted from every step the engine reports (observe_step), target on or off."""
        self.long_share = LongPrefillShare()
        """The prefill time long and short prompts got lately: long prefills behind their
        share go before short prompts (prefill_share.py)."""
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
        self.clock = time.monotonic
        """Requests' arrivals are on this clock (tests give both a fake one)."""
        self.forgotten_ids: list[str] = []
        """Requests the workers should drop at the next step: finished, aborted or preempted
        since the last one."""
        self.unknown_to_workers: set[str] = set()
        """Running requests a replaced rank group has not seen (keep_pool_after_restart):
        their next work is sent as new, with the whole block table."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        # In flight when an engine core died: the gateway resumes it on this one, and one
        # that was generating goes before prompts (cut off mid-prefill or never started).
        request.recovering = request.num_failures > 0
        self.requests[request.request_id] = request
        self.ledger.on_arrival(request.tenant)
        if request.recovering and request.output_token_ids:
            self.waiting.add_interrupted(request)
        else:
            self.waiting.add(request)

    def finish(self, request: Request, status: RequestStatus, stop_reason=None) -> None:
        """End a request for good: free its blocks and tell the workers to forget it."""
        if request.status.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.forgotten_ids.append(request.request_id)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        release_swap(self.swap_space, request)
        self.unknown_to_workers.discard(request.request_id)
        self.long_prompts.discard(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        request.status = status
        request.stop_reason = stop_reason
        self.ledger.on_departure(request.tenant)
        del self.requests[request.request_id]

    def schedule(self) -> SchedulerOutput:
        """The next step: running requests' next tokens, then waiting requests while room is
        left, and what the workers should forget."""
        budget, config = self.config.max_num_batched_tokens, self.config
        step = StepDraft(budget, long_prefill_allowance(config, budget, len(self.running),
                                                        self.waiting, self.is_long))
        self.long_first = self.long_share.owed(config)
        long = self.is_long

        def short(request: Request) -> bool:
            return self._is_prefilling(request) and not long(request)

        step.alone_limit_s = self._alone_limit()
        if step.alone_limit_s is None:
            self._continue_running(step, lambda r: not self._is_prefilling(r))  # decodes
        else:  # no work for the decodes this step, but they are not preemption's victims
            step.scheduled.update(r.request_id for r in self.running
                                  if not self._is_prefilling(r))
        # Under long_prefill_alone, long chunks stay out of a step that decodes.
        with_long = not (step.decodes and prefill_steps_apart(config))
        if self.long_first and with_long:  # behind their share of the prefill time
            self._continue_running(step, long)
            self._continue_running(step, short)
        else:  # short prompts, running and waiting, then long chunks get what is left
            self._continue_running(step, short)
            admit_waiting(self, step, long_prompts=False)
            if with_long:
                self._continue_running(step, long)
        if with_long:
            admit_waiting(self, step, long_prompts=True)
        self.last_step_alone = step.alone_limit_s is not None
        self._count_prefill_time(step)
        forgotten, self.forgotten_ids = self.forgotten_ids, []
        return step.done(forgotten)

    def _alone_limit(self) -> float | None:
        """The predicted seconds this step may take as a prefill step between decode steps
        (long_prefill_alone: streams decode, a long prefill is pending, and the latest step
        decoded); None: an ordinary step."""
        config = self.config
        if (self.last_step_alone or not prefill_steps_apart(config)
                or not self.step_cost.num_observations):
            return None
        decoding = [r for r in self.running if not self._is_prefilling(r)]
        long_pending = (any(self.is_long(r) for r in self.running)
                        or any(self.is_long(r) for r in self.waiting))
        if not (decoding and long_pending):
            return None
        return alone_step_seconds(config, self.step_cost, decoding)

    def is_long(self, request: Request) -> bool:
        """request's prefill is in the long class: long when it was admitted, or waiting with
        a long prefill ahead of it beyond what the prefix cache holds (a request behind a
        cached 2,000-token system prompt is short)."""
        if request.status == RequestStatus.RUNNING:
            return request.request_id in self.long_prompts and self._is_prefilling(request)
        return is_long_prefill(self.config, request,
                               self.block_manager.cached_prefix_tokens(request))

    def _count_prefill_time(self, step: StepDraft) -> None:
        """Count the step's predicted prefill seconds per class (for long_share)."""
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
            self.long_share.count(self.clock(), long_s, short_s)

    def _continue_running(self, step: StepDraft, which) -> None:
        """A pass over the running requests which(request) picks: their next tokens,
        preempting where the pool is dry, in running order. schedule() passes decodes
        first, then prefill chunks, short prompts' before long ones' unless those are owed
        their share: a long prompt that arrived first must not take the budget from streams
        already generating, nor from a chat prompt behind it."""
        for request in [r for r in self.running if which(r)]:
            if step.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self.is_suspect(request):
                if step.suspect_taken:
                    continue
                step.suspect_taken = True
            num_new = self.num_new_tokens(request, step.budget)
            prefill_time = None
            if self._is_prefilling(request):
                prefill_time = step.prefill_time(self.config, self.step_cost)
                limit = limit_for(self.config, request, prefill_time, step.decodes,
                                  self.is_long(request))
                if limit is not None:
                    num_new = prefill_time.tokens(request.num_computed_tokens, num_new, limit)
                    if num_new == 0:
                        continue
            if self.is_long(request):
                num_new = min(num_new, step.long_left)
                if num_new == 0:
                    continue
                step.long_left -= num_new
            drafts = self._drafts(request, num_new, step)
            # Drafted positions take only blocks free beyond one for each running request
            # still to be given work: drafts never make anyone be preempted.
            unscheduled = len(self.running) - len(step.scheduled) - 1
            new_blocks = (self.block_manager.allocate(request, num_new + len(drafts),
                                                      reserve=max(0, unscheduled))
                          if drafts else None)
            if new_blocks is None:
                drafts = []
                new_blocks = allocate_or_preempt(self, request, num_new, step)
            if new_blocks is None:
                continue
            if prefill_time is not None:
                prefill_time.take(request.num_computed_tokens, num_new)  # limited or not
            step.scheduled.add(request.request_id)
            is_new = request.request_id in self.unknown_to_workers
            if is_new:  # the workers learn its whole block table, as at an admission
                self.unknown_to_workers.discard(request.request_id)
                new_blocks = list(request.block_ids)
            work = ScheduledWork(request, request.num_computed_tokens, num_new + len(drafts),
                                 new_blocks, is_new, draft_token_ids=drafts)
            if self.speculator is not None:  # a step may have given blocks back (update)
                work.kept_blocks = len(request.block_ids) - len(new_blocks)
            (step.decodes if work.is_decode or work.is_verify else step.prefills).append(work)
            step.spend(work.num_tokens)

    def _drafts(self, request: Request, num_new: int, step: StepDraft) -> list[int]:
        """Drafted tokens to verify after request's last one this step ([] unless it
        decodes with speculation on): at most what the budget has room for, and no more than
        could be kept before max_tokens or the model's context ends it; under auto, those
        that pay at this step's batch (draft_length.py)."""
        if self.speculator is None or num_new != 1 or self._is_prefilling(request):
            return []
        most = min(step.budget - 1,
                   request.params.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)

        def price() -> StepPrice:  # the speculator asks once a step, under auto only
            decoding = [r for r in self.running if not self._is_prefilling(r)]
            # A decode's one row attends every token of its request.
            return StepPrice.of(self.step_cost, len(decoding),
                                sum(r.num_tokens for r in decoding))
        return self.speculator.draft(request, most, step, price)

    def num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens of request to compute this step: one for a decode, else a prefill chunk."""
        remaining = request.num_tokens - request.num_computed_tokens
        if not self.config.chunked_prefill:
            return remaining
        return min(remaining, budget, self.config.max_prefill_chunk or budget)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine ran out's work in seconds (schedule to emit): refit the step cost."""
        if out.work:
            self.step_cost.observe(step_shape(out.work), seconds)

    def is_suspect(self, request: Request) -> bool:
        """request may be what breaks the replica (see suspect_after_failures)."""
        return 0 < self.suspect_after_failures <= request.num_failures

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > 1

    def requeue_all(self) -> None:
        """The rank group is gone, and the pool's and host buffers' contents with it: every
        running request goes back to the front of the line, in its order, to be recomputed
        from prompt + output; every block, pool or host, is forgotten."""
        # Those generating back first, then those cut off mid-prefill, each in running order.
        for request in sorted(reversed(self.running), key=lambda r: not self._is_prefilling(r)):
            self.running.remove(request)
            request.status = RequestStatus.PREEMPTED
            request.recovering = True
            self.waiting.push_front(request)
        for request in self.waiting:
            self.block_manager.free(request)
            release_swap(self.swap_space, request)
            request.num_computed_tokens = 0
        self.block_manager.reset()
        if self.swap_space is not None:
            self.swap_space.reset()
        self.forgotten_ids = []  # the new ranks know nothing to forget
        self.unknown_to_workers.clear()

    def keep_pool_after_restart(self, failed: SchedulerOutput | None) -> bool:
        """The rank group was replaced by one that maps the same KV memory (a CPU pool outlives
        its ranks): every block the bookkeeping says is computed still is, so each request
        keeps its blocks and computed tokens. The failed step had advanced none of them
        (update never ran), so it is simply run again; the new ranks learn each running
        request at its next step. False, changing nothing, where host blocks are in play
        (swap mode: host buffers die with their ranks, and a failed step's copies may not
        have happened): the caller then requeues everything (requeue_all)."""
        swapping = failed is not None and (failed.swap_in or failed.swap_out)
        if swapping or any(r.swapped_block_ids for r in self.requests.values()):
            return False
        self.unknown_to_workers = {r.request_id for r in self.running}
        self.forgotten_ids = []  # the new ranks know nothing to forget
        return True

    def check(self, rehash: bool = True) -> list[str]:
        """What is wrong with the block bookkeeping (empty when nothing is): the block
        manager's and swap space's own checks over every live request, and only running
        requests hold pool blocks (only waiting ones host blocks)."""
        live = list(self.requests.values())
        problems = self.block_manager.check(live, rehash)
        if self.swap_space is not None:
            problems += self.swap_space.check(r.swapped_block_ids for r in live)
        for request in live:
            if request.block_ids and request.status != RequestStatus.RUNNING:
                problems.append(f"{request.request_id} is {request.status.name.lower()} but "
                                f"holds {len(request.block_ids)} pool blocks")
            if request.swapped_block_ids and request.status == RequestStatus.RUNNING:
                problems.append(f"{request.request_id} runs but holds host blocks")
        return problems

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        """Apply a step's results; return the requests that gained tokens (in work order):
        one each, or, after drafts, the accepted ones and the token sampled after them."""
        sampled = iter(sampled_token_ids)
        advanced = []
        for work in out.work:
            request = work.request
            if work.is_verify:
                tokens = [next(sampled) for _ in range(1 + len(work.draft_token_ids))]
                if self._verified(work, tokens):
                    advanced.append(request)
                continue
            request.num_computed_tokens = work.start + work.num_tokens
            if self.speculator is not None and request.status == RequestStatus.RUNNING:
                # Blocks a failed step took for drafts (keep_pool_after_restart ran it again
                # without them) go back as a verification's rejected ones do.
                self.block_manager.trim(request)
            self.block_manager.cache_full_blocks(request)
            if not work.samples:
                continue
            token = next(sampled)
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            self._append(request, [token])
            advanced.append(request)
            self._check_stop(request, token)
        return advanced

    def _verified(self, work: ScheduledWork, sampled: list[int]) -> bool:
        """A decode with drafts ran: append the accepted drafts and the token sampled after
        them (up to the first that ends the request), keep their positions' K/V and give
        back the blocks only rejected positions used. False when it was aborted meanwhile."""
        request = work.request
        accepted = self.speculator.verified(request.request_id, work.draft_token_ids, sampled)
        if request.status != RequestStatus.RUNNING:
            return False  # aborted while the step ran: its blocks are already back
        tokens = sampled[:accepted + 1]
        for kept, token in enumerate(tokens, 1):
            if self._stop_of(request, token, request.num_output_tokens + kept) is not None:
                tokens = tokens[:kept]
                break
        self._append(request, tokens)
        # K/V is kept for the last token and the accepted drafts the output now holds.
        request.num_computed_tokens = work.start + len(tokens)
        self.block_manager.trim(request)
        self.block_manager.cache_full_blocks(request)
        self._check_stop(request, tokens[-1])
        return True

    def _append(self, request: Request, tokens: list[int]) -> None:
        request.output_token_ids.extend(tokens)
        request.recovering = False
        if request.first_token_at is None:
            request.first_token_at = self.clock()
        self.ledger.charge_output(request.tenant, len(tokens), request.weight)

    def _check_stop(self, request: Request, token: int) -> None:
        stop = self._stop_of(request, token, request.num_output_tokens)
        if stop is not None:
            self.finish(request, *stop)

    def _stop_of(self, request: Request, token: int,
                 num_output_tokens: int) -> tuple[RequestStatus, str | int | None] | None:
        """How request ends if token is its output token num_output_tokens (counted from 1),
        as (status, stop reason); None if it goes on."""
        params = request.params
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if not params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if len(request.prompt_token_ids) + num_output_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None
