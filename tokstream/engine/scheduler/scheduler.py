"""Continuous batching: every step is rebuilt from the running and waiting requests.

A step is a token budget filled with running requests first (decodes, and prompts part-way
through a chunked prefill), then new prompts while blocks, the budget and the sequence cap
allow (admission.py). With chunking off a prompt is taken whole, past the budget if need be.
Under an ITL target a step that carries decodes takes only the prefill its learned step cost
says fits under the target (at least a small floor, so waiting prompts progress); long
prefills take what short prompts leave, or steps of their own (prefill_policy.py makes every
such decision). When the pool runs dry mid-generation the lowest-priority, latest-arrived
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
from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.draft_length import StepPrice
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.admission import Admission
from tokstream.engine.scheduler.fairness import FairnessLedger
from tokstream.engine.scheduler.output import ScheduledWork, SchedulerOutput, step_shape
from tokstream.engine.scheduler.preemption import Preemption, release_swap
from tokstream.engine.scheduler.prefill_policy import PrefillPolicy, is_prefilling
from tokstream.engine.scheduler.step_cost import StepCostModel
from tokstream.engine.scheduler.step_draft import StepDraft
from tokstream.engine.scheduler.waiting_queue import WaitingQueue
from tokstream.engine.speculation import Speculator


class Scheduler:
    """Builds each step from the running and waiting requests (schedule) and applies what the
    step sampled (update); owns the requests' queues and their blocks."""

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
        self.prefill_policy = PrefillPolicy(config, StepCostModel(), block_manager)
        """Whose prefill each step carries and how much of it (prefill_policy.py)."""
        self.clock = time.monotonic
        """Requests' arrivals are on this clock (tests give both a fake one)."""
        self.forgotten_ids: list[str] = []
        """Requests the workers should drop at the next step: finished, aborted or preempted
        since the last one."""
        self.unknown_to_workers: set[str] = set()
        """Running requests a replaced rank group has not seen (keep_pool_after_restart):
        their next work is sent as new, with the whole block table."""
        # The two helpers share the lists and sets above (changed in place, never replaced).
        self.preemption = Preemption(block_manager, swap_space, self.running, self.waiting,
                                     self.forgotten_ids)
        self.admission = Admission(config, self.prefill_policy, block_manager, swap_space,
                                   self.waiting, self.running, self.ledger,
                                   self.unknown_to_workers, self.finish)

    @property
    def step_cost(self) -> StepCostModel:
        """What a step costs, fitted from every step the engine reports (observe_step)."""
        return self.prefill_policy.step_cost

    @property
    def num_preemptions(self) -> int:
        return self.preemption.num_preemptions

    @property
    def num_swap_outs(self) -> int:
        """Of the preemptions, those that kept their KV in host memory."""
        return self.preemption.num_swap_outs

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
        self.prefill_policy.forget(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        request.status = status
        request.stop_reason = stop_reason
        self.ledger.on_departure(request.tenant)
        del self.requests[request.request_id]

    def schedule(self) -> SchedulerOutput:
        """The next step: running requests' next tokens, then waiting requests while room is
        left, and what the workers should forget."""
        policy = self.prefill_policy
        step = policy.open_step(self.running, self.waiting, self.suspect_after_failures)
        if any(not r.background for r in self.running):  # chat first: batches use idle steps
            step.background_room = self.config.background_rows_when_busy
        long = policy.is_long

        def short(request: Request) -> bool:
            return is_prefilling(request) and not long(request)

        if step.alone_limit_s is None:
            self._continue_running(step, lambda r: not is_prefilling(r))  # decodes
        else:  # no work for the decodes this step, but they are not preemption's victims
            step.scheduled.update(r.request_id for r in self.running if not is_prefilling(r))
        policy.allow_prefill(step)
        # Under long_prefill_alone, long chunks stay out of a step that decodes, and short
        # prompts too when a prefill step follows it.
        with_long = not (step.decodes and policy.steps_apart)
        with_short = not (step.decodes and policy.prefill_step_follows(self.running,
                                                                       self.waiting))
        if policy.long_first and with_long:  # behind their share of the prefill time
            self._continue_running(step, long)
            self._continue_running(step, short)
        elif with_short:  # short prompts, running and waiting, then long chunks get the rest
            self._continue_running(step, short)
            self.admission.admit(step, long_prompts=False)
            if with_long:
                self._continue_running(step, long)
        if with_long:
            self.admission.admit(step, long_prompts=True)
        policy.close_step(step, self.clock)
        forgotten = list(self.forgotten_ids)
        self.forgotten_ids.clear()
        return step.done(forgotten)

    def _continue_running(self, step: StepDraft, which) -> None:
        """A pass over the running requests which(request) picks: their next tokens,
        preempting where the pool is dry, in running order. schedule() passes decodes
        first, then prefill chunks, short prompts' before long ones' unless those are owed
        their share: a long prompt that arrived first must not take the budget from streams
        already generating, nor from a chat prompt behind it."""
        policy = self.prefill_policy
        for request in [r for r in self.running if which(r)]:
            if step.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not step.takes(request):
                continue  # a second suspect
            num_new = policy.num_new_tokens(request, step.budget)
            prefilling, long = is_prefilling(request), policy.is_long(request)
            if prefilling:
                num_new = policy.chunk_tokens(step, request, num_new, long)
                if num_new == 0:
                    continue
            if long:
                num_new = step.take_long(num_new)
                if num_new == 0:
                    continue
            drafts = self._drafts(request, num_new, step)
            # Drafted positions take only blocks free beyond one for each running request
            # still to be given work: drafts never make anyone be preempted.
            unscheduled = len(self.running) - len(step.scheduled) - 1
            new_blocks = (self.block_manager.allocate(request, num_new + len(drafts),
                                                      reserve=max(0, unscheduled))
                          if drafts else None)
            if new_blocks is None:
                drafts = []
                new_blocks = self.preemption.allocate_or_preempt(request, num_new, step)
            if new_blocks is None:
                if request.status == RequestStatus.RUNNING:  # alone, too big for the pool
                    self.finish(request, RequestStatus.FINISHED_LENGTH, "kv_cache_capacity")
                    step.out.finished.append(request)
                continue
            if prefilling:
                step.took_prefill(request.num_computed_tokens, num_new)  # limited or not
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
        if self.speculator is None or num_new != 1 or is_prefilling(request):
            return []
        most = min(step.budget - 1,
                   request.params.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)

        def price() -> StepPrice:  # the speculator asks once a step, under auto only
            decoding = [r for r in self.running if not is_prefilling(r)]
            # A decode's one row attends every token of its request.
            return StepPrice.of(self.step_cost, len(decoding),
                                sum(r.num_tokens for r in decoding))
        return self.speculator.draft(request, most, step, price)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine ran out's work in seconds (schedule to emit): refit the step cost."""
        if out.work:
            self.step_cost.observe(step_shape(out.work), seconds)

    def requeue_all(self) -> None:
        """The rank group is gone, and the pool's and host buffers' contents with it: every
        running request goes back to the front of the line, in its order, to be recomputed
        from prompt + output; every block, pool or host, is forgotten."""
        # Those generating back first, then those cut off mid-prefill, each in running order.
        for request in sorted(reversed(self.running), key=lambda r: not is_prefilling(r)):
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
        self.forgotten_ids.clear()  # the new ranks know nothing to forget
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
        self.unknown_to_workers.clear()
        self.unknown_to_workers.update(r.request_id for r in self.running)
        self.forgotten_ids.clear()  # the new ranks know nothing to forget
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

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int],
               unsampled: frozenset[str] | set[str] = frozenset()) -> list[Request]:
        """Apply a step's results; return the requests that gained tokens (in work order):
        one each, or, after drafts, the accepted ones and the token sampled after them.
        unsampled: requests whose work sampled nothing (their grammar was not ready: see
        sample_again); sampled_token_ids holds no token of theirs."""
        sampled = iter(sampled_token_ids)
        advanced = []
        for work in out.work:
            request = work.request
            if request.request_id in unsampled:
                self.sample_again(work)
                continue
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

    def sample_again(self, work: ScheduledWork) -> None:
        """work's step computed its tokens but sampled nothing after them (rank 0 held the
        request back while its grammar compiled): its last position counts as not computed,
        so a later step computes it again as a decode, and samples there. Its drafts, never
        verified, give their blocks back."""
        request = work.request
        if request.status != RequestStatus.RUNNING:
            return  # ended while the step ran: its blocks are already back
        request.num_computed_tokens = request.num_tokens - 1
        if self.speculator is not None:  # only then do workers hear of dropped blocks
            self.block_manager.trim(request)
        self.block_manager.cache_full_blocks(request)

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
        if num_output_tokens > params.min_tokens:  # before, the sampler bans them
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
        if num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if len(request.prompt_token_ids) + num_output_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None
