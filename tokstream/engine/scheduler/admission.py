"""Admission into a step: the second pass of Scheduler.schedule(), after the running requests.
Waiting requests (new prompts, preempted and resumed requests) start in the waiting queue's
order while the step's budget, the sequence cap and free blocks allow, each with the whole
block table it holds (a cached prefix included). Not the gateway's admission bounds
(tokstream/server/access/gateway_admission.py). Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from tokstream.config import SchedulerConfig
from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.fairness import FairnessLedger
from tokstream.engine.scheduler.output import ScheduledWork
from tokstream.engine.scheduler.preemption import release_swap
from tokstream.engine.scheduler.prefill_policy import PrefillPolicy, is_prefilling
from tokstream.engine.scheduler.step_draft import StepDraft
from tokstream.engine.scheduler.waiting_queue import WaitingQueue


def running_order(request: Request) -> tuple:
    return (request.priority, request.arrival)


class Admission:
    """Starts waiting requests in a step: moves them to the running list with their first
    chunk and their blocks."""

    def __init__(self, config: SchedulerConfig, policy: PrefillPolicy, blocks: BlockManager,
                 swap_space: SwapSpace | None, waiting: WaitingQueue, running: list[Request],
                 ledger: FairnessLedger, unknown_to_workers: set[str],
                 finish: Callable[[Request, RequestStatus, str], None]):
        self.config = config
        self.policy = policy
        self.blocks = blocks
        self.swap_space = swap_space
        """A swapped request's host blocks are freed once it is copied back in."""
        self.waiting = waiting
        self.running = running
        """The scheduler's running requests, kept in running order."""
        self.ledger = ledger
        """Charged a request's prompt at its first start."""
        self.unknown_to_workers = unknown_to_workers
        """The scheduler's set of running requests the workers have not seen: an admission
        sends the whole block table, so a request started is known."""
        self.finish = finish
        """Ends a request for good (Scheduler.finish): one too big for the whole pool."""

    def admit(self, step: StepDraft, long_prompts: bool = True) -> None:
        """Start waiting requests until the next one does not fit this step; long prompts too
        only if long_prompts (short ones are admitted before long prefills' chunks). None
        start in a step that had to preempt: the pool is tight."""
        config, blocks = self.config, self.blocks
        held = groups_prefilling(self.running, blocks)
        # Prefix blocks running requests are computing: a waiting request that needs one next
        # waits for the cache to have it (a burst behind one new system prompt computes it
        # once).
        pending = blocks.blocks_in_flight(r for r in self.running if is_prefilling(r))
        while self.waiting and step.budget > 0 and not step.out.preempted:
            if len(self.running) >= config.max_num_seqs:
                break
            request = self._next_request(step, held, long_prompts, pending)
            if request is None:
                break
            if can_never_fit(config, blocks, request):
                self.finish(request, RequestStatus.FINISHED_LENGTH, "kv_cache_capacity")
                step.out.finished.append(request)
                continue
            if not self._start(step, request, held):
                break
            pending |= blocks.blocks_in_flight([request])

    def _next_request(self, step: StepDraft, held: set[str], long_prompts: bool,
                      pending: set[bytes]) -> Request | None:
        """The request to start next; None when the rest wait for a later step."""
        config, is_long = self.config, self.policy.is_long
        request = self.waiting.peek(
            lambda r: may_start(config, self.running, r)
            and ((long_prompts and step.long_left > 0) or not is_long(r))
            and step.may_take(r) and r.prompt_group not in held
            and not self.blocks.prefix_in_flight(r, pending))
        if request is None:
            return None
        if not long_prompts and is_long(request):
            return None  # a preempted long prompt, first in line: it comes back in order
        if request.prompt_group in held:
            return None  # a preempted member: those come back in order, after its prompt's blocks
        if not step.takes(request):
            return None  # preempted requests come back in order: the rest wait a step
        return request

    def _start(self, step: StepDraft, request: Request, held: set[str]) -> bool:
        """Move request from waiting to running with its first chunk in the step; False when
        it does not fit (it stays waiting)."""
        blocks, policy = self.blocks, self.policy
        swapped = request.is_swapped
        if not swapped:
            blocks.match_prefix(request)  # cached prefix blocks count as computed
        start = request.num_computed_tokens
        long = policy.is_long_prefill(request)  # its cached prefix counted
        num_new = policy.chunk_tokens(step, request,
                                      policy.num_new_tokens(request, step.budget), long)
        if num_new == 0:  # deeper into its prompt (a cached prefix) than time allows
            return _stay_waiting(blocks, request, swapped)
        if long:
            num_new = step.take_long(num_new)
        if num_new > step.budget and step.prefills:
            # Chunking off: a whole prompt past the budget goes first in a later step.
            return _stay_waiting(blocks, request, swapped)
        if blocks.allocate(request, num_new, reserve=self.config.watermark_blocks) is None:
            return _stay_waiting(blocks, request, swapped)  # give the prefix back until it fits
        step.took_prefill(start, num_new)
        if swapped:
            # Host blocks are copied back into the first new pool blocks before the forward
            # pass. They can be freed now: no swap-out follows an admission in one step.
            step.out.swap_in += zip(request.swapped_block_ids, request.block_ids)
            release_swap(self.swap_space, request)
        self.waiting.remove(request)
        policy.admitted(request, long)
        bisect.insort(self.running, request, key=running_order)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled is None:
            request.first_scheduled = time.monotonic()
            self.ledger.charge_input(request.tenant, len(request.prompt_token_ids),
                                     request.weight)
        # New to the worker: it learns the whole block table, cached prefix included.
        self.unknown_to_workers.discard(request.request_id)
        step.prefills.append(ScheduledWork(request, start, num_new, list(request.block_ids),
                                           True))
        step.scheduled.add(request.request_id)  # its chunk is in the step: no victim now
        step.spend(num_new)
        if start < shared_prompt_tokens(blocks, request):
            held.add(request.prompt_group)  # its blocks are cached after this step
        return True


def _stay_waiting(blocks: BlockManager, request: Request, swapped: bool) -> bool:
    """request waits for a later step, and gives back the cached prefix match_prefix gave it:
    a waiting request holds no pool blocks (a rank-group restart forgets every block, and
    would leave it holding some). A swapped one was given none. Always False."""
    if not swapped:
        blocks.free(request)
    return False


def shared_prompt_tokens(blocks: BlockManager, request: Request) -> int:
    """Tokens of request's prompt the prefix cache can hand its group's other members:
    the full blocks of the prompt (0 when it has no group or there is no cache)."""
    if not (request.prompt_group and blocks.enable_caching):
        return 0
    size = blocks.block_size
    return min(len(request.prompt_token_ids) // size, (request.num_tokens - 1) // size) * size


def groups_prefilling(running: list[Request], blocks: BlockManager) -> set[str]:
    """Prompt groups with a running member still computing the shared prompt blocks: the
    others wait until those are in the prefix cache rather than compute them again."""
    return {r.prompt_group for r in running
            if r.num_computed_tokens < shared_prompt_tokens(blocks, r)}


def may_start(config: SchedulerConfig, running: list[Request], request: Request) -> bool:
    """Per-tenant cap on long requests, so one tenant's long prompts cannot fill the pool."""
    cap = config.max_long_requests_per_tenant
    if not cap or len(request.prompt_token_ids) < config.long_request_tokens:
        return True
    running_long = sum(1 for r in running if r.tenant == request.tenant
                       and len(r.prompt_token_ids) >= config.long_request_tokens)
    return running_long < cap


def can_never_fit(config: SchedulerConfig, blocks: BlockManager, request: Request) -> bool:
    usable = blocks.num_blocks - config.watermark_blocks
    return blocks.blocks_for(request.num_tokens + 1) > usable
