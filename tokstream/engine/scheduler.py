"""Continuous batching: every step is rebuilt from the running and waiting requests.

A step is a token budget filled with running requests first (decodes, and prompts part-way
through a chunked prefill), then new prompts while blocks, the budget and the sequence cap
allow. With chunking off a prompt is taken whole, past the budget if need be. Under an ITL
target a step that carries decodes takes only the prefill its learned step cost says fits under
the target (at least a small floor, so waiting prompts progress). When the pool
runs dry mid-generation the lowest-priority, latest-arrived running request is preempted: its
blocks are freed and it is recomputed from prompt + output later, or, in swap mode, its blocks
are copied to host memory first and copied back on re-admission. Either way its stream is
unchanged. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import time

from tokstream.config import SchedulerConfig
from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.fairness import FairnessLedger
from tokstream.engine.prefill_share import (PrefillTime, is_long_prefill, limit_for,
                                            long_prefill_allowance, prefill_allowance,
                                            time_share)
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduled import ScheduledWork, SchedulerOutput, step_shape
from tokstream.engine.step_cost import StepCostModel
from tokstream.engine.waiting_queue import WaitingQueue


def running_order(request: Request) -> tuple:
    return (request.priority, request.arrival)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), swap_space: SwapSpace | None = None,
                 suspect_after_failures: int = 0):
        self.config = config
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
        self.clock = time.monotonic
        """Requests' arrivals are on this clock (tests give both a fake one)."""
        """Fitted from every step the engine reports (observe_step), target on or off."""
        self._forgotten: list[str] = []

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
            self._forgotten.append(request.request_id)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        self._release_swap(request)
        request.status = status
        request.stop_reason = stop_reason
        self.ledger.on_departure(request.tenant)
        del self.requests[request.request_id]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledWork] = []
        prefills: list[ScheduledWork] = []
        long_left = long_prefill_allowance(self.config, budget, len(self.running), self.waiting)
        # The ITL allowance needs this step's decodes, so it is set at the first prefill chunk.
        prefill_time: PrefillTime | None = None
        prefill_time_known = False

        scheduled: set[str] = set()
        suspect_taken = False
        # Decodes before prefill chunks, each group in running order: a long prompt that
        # arrived first must not take the budget from streams already generating.
        for request in sorted(self.running, key=self._is_prefilling):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._is_suspect(request):
                if suspect_taken:
                    continue
                suspect_taken = True
            num_new = self._num_new_tokens(request, budget)
            prefilling = self._is_prefilling(request)
            limit = None
            if prefilling:
                if not prefill_time_known:
                    prefill_time = prefill_allowance(self.config, self.step_cost, decodes)
                    prefill_time_known = True
                limit = limit_for(self.config, request, prefill_time, decodes)
                if limit is not None:
                    num_new = limit.tokens(request.num_computed_tokens, num_new,
                                           time_share(self.config, request, long_left))
                    if num_new == 0:
                        continue
            if is_long_prefill(self.config, request):
                num_new = min(num_new, long_left)
                if num_new == 0:
                    continue
                long_left -= num_new
            new_blocks = self._allocate_or_preempt(request, num_new, out, scheduled)
            if new_blocks is None:
                continue
            if prefilling and prefill_time is not None:
                prefill_time.take(request.num_computed_tokens, num_new)  # limited or not
            scheduled.add(request.request_id)
            work = ScheduledWork(request, request.num_computed_tokens, num_new, new_blocks, False)
            (decodes if work.is_decode else prefills).append(work)
            budget = max(0, budget - num_new)

        if not prefill_time_known:
            prefill_time = prefill_allowance(self.config, self.step_cost, decodes)
        held = self._groups_prefilling()
        # No admissions in a step that had to preempt: the pool is tight.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek(
                lambda r: self._may_start(r)
                and (long_left > 0 or not is_long_prefill(self.config, r))
                and not (suspect_taken and self._is_suspect(r)) and r.prompt_group not in held)
            if request is None:
                break
            if request.prompt_group in held:
                break  # a preempted member: those come back in order, after its prompt's blocks
            if self._is_suspect(request):
                if suspect_taken:
                    break  # preempted requests come back in order: the rest wait a step
                suspect_taken = True
            if self._can_never_fit(request):
                self.finish(request, RequestStatus.FINISHED_LENGTH, "kv_cache_capacity")
                out.finished.append(request)
                continue
            swapped = request.is_swapped
            if not swapped:
                self.block_manager.match_prefix(request)  # cached prefix blocks count as computed
            start = request.num_computed_tokens
            num_new = self._num_new_tokens(request, budget)
            limit = limit_for(self.config, request, prefill_time, decodes)
            if limit is not None:
                num_new = limit.tokens(start, num_new, time_share(self.config, request, long_left))
                if num_new == 0:  # deeper into its prompt (a cached prefix) than time allows
                    if not swapped:
                        self.block_manager.free(request)
                    break
            if is_long_prefill(self.config, request):
                num_new = min(num_new, long_left)
                long_left -= num_new
            if num_new > budget and prefills:
                # Chunking off: a whole prompt past the budget goes first in a later step. Its
                # cached prefix goes back meanwhile: a waiting request holds no pool blocks
                # (a rank-group restart forgets every block, and would leave it holding some).
                if not swapped:
                    self.block_manager.free(request)
                break
            if self.block_manager.allocate(
                    request, num_new, reserve=self.config.watermark_blocks) is None:
                if not swapped:
                    self.block_manager.free(request)  # give the prefix back until it fits
                break
            if prefill_time is not None:
                prefill_time.take(start, num_new)
            if swapped:
                # Host blocks are copied back into the first new pool blocks before the forward
                # pass. They can be freed now: no swap-out follows an admission in one step.
                out.swap_in += zip(request.swapped_block_ids, request.block_ids)
                self._release_swap(request)
            self.waiting.remove(request)
            bisect.insort(self.running, request, key=running_order)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled is None:
                request.first_scheduled = time.monotonic()
                self.ledger.charge_input(request.tenant, len(request.prompt_token_ids),
                                         request.weight)
            # New to the worker: it learns the whole block table, cached prefix included.
            prefills.append(ScheduledWork(request, start, num_new, list(request.block_ids), True))
            budget = max(0, budget - num_new)
            if start < self._shared_prompt_tokens(request):
                held.add(request.prompt_group)  # its blocks are cached after this step

        out.work = decodes + prefills
        out.forgotten_ids, self._forgotten = self._forgotten, []
        return out

    def _shared_prompt_tokens(self, request: Request) -> int:
        """Tokens of request's prompt the prefix cache can hand its group's other members:
        the full blocks of the prompt (0 when it has no group or there is no cache)."""
        if not (request.prompt_group and self.block_manager.enable_caching):
            return 0
        size = self.block_manager.block_size
        return min(len(request.prompt_token_ids) // size, (request.num_tokens - 1) // size) * size

    def _groups_prefilling(self) -> set[str]:
        """Prompt groups with a running member still computing the shared prompt blocks: the
        others wait until those are in the prefix cache rather than compute them again."""
        return {r.prompt_group for r in self.running
                if r.num_computed_tokens < self._shared_prompt_tokens(r)}

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens of request to compute this step: one for a decode, else a prefill chunk."""
        remaining = request.num_tokens - request.num_computed_tokens
        if not self.config.chunked_prefill:
            return remaining
        return min(remaining, budget, self.config.max_prefill_chunk or budget)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine ran out's work in seconds (schedule to emit): refit the step cost."""
        if out.work:
            self.step_cost.observe(step_shape(out.work), seconds)

    def _is_suspect(self, request: Request) -> bool:
        return 0 < self.suspect_after_failures <= request.num_failures

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > 1

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput,
                             scheduled: set[str]) -> list[int] | None:
        while True:
            new_blocks = self.block_manager.allocate(request, num_new)
            if new_blocks is not None:
                return new_blocks
            # The least important request not yet given work this step (request itself at
            # the latest).
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            if victim is request and len(self.running) == 1:
                # Alone and still too big for the whole pool: it can never continue.
                self.finish(request, RequestStatus.FINISHED_LENGTH, "kv_cache_capacity")
                out.finished.append(request)
                return None
            self._preempt(victim, out)
            if victim is request:
                return None

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
            self._release_swap(request)
            request.num_computed_tokens = 0
        self.block_manager.reset()
        if self.swap_space is not None:
            self.swap_space.reset()
        self._forgotten = []  # the new ranks know nothing to forget

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

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if not self._swap_out(request, out):
            self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)
        self._forgotten.append(request.request_id)
        out.preempted.append(request)

    def _swap_out(self, request: Request, out: SchedulerOutput) -> bool:
        """Free request's pool blocks but keep their content in host blocks; False (recompute)
        when swap is off or the host blocks are short."""
        num_blocks = self.block_manager.blocks_for(request.num_computed_tokens)
        if self.swap_space is None or num_blocks == 0:
            return False
        host_ids = self.swap_space.allocate(num_blocks)
        if host_ids is None:
            return False
        # The worker copies these out before the step's forward pass, so the freed pool blocks
        # may be handed to another request in this same step.
        out.swap_out += zip(request.block_ids[:num_blocks], host_ids)
        computed = request.num_computed_tokens
        self.block_manager.free(request)
        request.num_computed_tokens = computed
        request.swapped_block_ids = host_ids
        self.num_swap_outs += 1
        return True

    def _release_swap(self, request: Request) -> None:
        if request.swapped_block_ids:
            self.swap_space.free(request.swapped_block_ids)
            request.swapped_block_ids = []

    def _may_start(self, request: Request) -> bool:
        """Per-tenant cap on long requests, so one tenant's long prompts cannot fill the pool."""
        cap = self.config.max_long_requests_per_tenant
        if not cap or len(request.prompt_token_ids) < self.config.long_request_tokens:
            return True
        running_long = sum(1 for r in self.running if r.tenant == request.tenant
                           and len(r.prompt_token_ids) >= self.config.long_request_tokens)
        return running_long < cap

    def _can_never_fit(self, request: Request) -> bool:
        usable = self.block_manager.num_blocks - self.config.watermark_blocks
        return self.block_manager.blocks_for(request.num_tokens + 1) > usable

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        """Apply a step's results; return the requests that gained a token (in work order)."""
        sampled = iter(sampled_token_ids)
        advanced = []
        for work in out.work:
            request = work.request
            request.num_computed_tokens = work.start + work.num_tokens
            self.block_manager.cache_full_blocks(request)
            if not work.samples:
                continue
            token = next(sampled)
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.output_token_ids.append(token)
            request.recovering = False
            if request.first_token_at is None:
                request.first_token_at = self.clock()
            self.ledger.charge_output(request.tenant, 1, request.weight)
            advanced.append(request)
            self._check_stop(request, token)
        return advanced

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.params
        if token in params.stop_token_ids:
            self.finish(request, RequestStatus.FINISHED_STOPPED, token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self.finish(request, RequestStatus.FINISHED_STOPPED, None)
        elif request.num_output_tokens >= params.max_tokens:
            self.finish(request, RequestStatus.FINISHED_LENGTH)
        elif request.num_tokens >= self.max_model_len:
            self.finish(request, RequestStatus.FINISHED_LENGTH)
