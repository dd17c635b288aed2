"""Admission into a step: the second pass of Scheduler.schedule(), after the running requests.
Waiting requests (new prompts, preempted and resumed requests) start in the waiting queue's
order while the step's budget, the sequence cap and free blocks allow, each with the whole
block table it holds (a cached prefix included). Not the gateway's admission bounds
(tokstream/server/access/gateway_admission.py). Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from tokstream.config import SchedulerConfig
from tokstream.engine.block_manager import BlockManager
from old_scheduler.prefill_share import PrefillTime, is_long_prefill, limit_for
from old_scheduler.preemption import release_swap
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.output import ScheduledWork
from old_scheduler.step_draft import StepDraft

if TYPE_CHECKING:
    from old_scheduler.scheduler import Scheduler


def running_order(request: Request) -> tuple:
    return (request.priority, request.arrival)


def admit_waiting(scheduler: Scheduler, step: StepDraft, long_prompts: bool = True) -> None:
    """Start waiting requests until the next one does not fit this step; long prompts too
    only if long_prompts (short ones are admitted before long prefills' chunks). None start
    in a step that had to preempt: the pool is tight."""
    config = scheduler.config
    prefill_time = step.prefill_time(config, scheduler.step_cost)
    blocks = scheduler.block_manager
    held = groups_prefilling(scheduler.running, blocks)
    # Prefix blocks running requests are computing: a waiting request that needs one next
    # waits for the cache to have it (a burst behind one new system prompt computes it once).
    pending = blocks.blocks_in_flight(r for r in scheduler.running
                                      if r.num_tokens - r.num_computed_tokens > 1)
    while scheduler.waiting and step.budget > 0 and not step.out.preempted:
        if len(scheduler.running) >= config.max_num_seqs:
            break
        request = _next_request(scheduler, step, held, long_prompts, pending)
        if request is None:
            break
        if can_never_fit(config, scheduler.block_manager, request):
            scheduler.finish(request, RequestStatus.FINISHED_LENGTH, "kv_cache_capacity")
            step.out.finished.append(request)
            continue
        if not _start(scheduler, step, request, prefill_time, held):
            break
        pending |= blocks.blocks_in_flight([request])


def _next_request(scheduler: Scheduler, step: StepDraft, held: set[str],
                  long_prompts: bool, pending: set[bytes]) -> Request | None:
    """The request to start next; None when the rest wait for a later step."""
    config = scheduler.config
    request = scheduler.waiting.peek(
        lambda r: may_start(config, scheduler.running, r)
        and ((long_prompts and step.long_left > 0) or not scheduler.is_long(r))
        and not (step.suspect_taken and scheduler.is_suspect(r)) and r.prompt_group not in held
        and not scheduler.block_manager.prefix_in_flight(r, pending))
    if request is None:
        return None
    if not long_prompts and scheduler.is_long(request):
        return None  # a preempted long prompt, first in line: it comes back in order
    if request.prompt_group in held:
        return None  # a preempted member: those come back in order, after its prompt's blocks
    if scheduler.is_suspect(request):
        if step.suspect_taken:
            return None  # preempted requests come back in order: the rest wait a step
        step.suspect_taken = True
    return request


def _start(scheduler: Scheduler, step: StepDraft, request: Request,
           prefill_time: PrefillTime | None, held: set[str]) -> bool:
    """Move request from waiting to running with its first chunk in the step; False when it
    does not fit (it stays waiting)."""
    config, blocks = scheduler.config, scheduler.block_manager
    swapped = request.is_swapped
    if not swapped:
        blocks.match_prefix(request)  # cached prefix blocks count as computed
    start = request.num_computed_tokens
    num_new = scheduler.num_new_tokens(request, step.budget)
    long = is_long_prefill(config, request)  # its cached prefix counted
    limit = limit_for(config, request, prefill_time, step.decodes, long)
    if limit is not None:
        num_new = prefill_time.tokens(start, num_new, limit)
        if num_new == 0:  # deeper into its prompt (a cached prefix) than time allows
            return _stay_waiting(blocks, request, swapped)
    if long:
        num_new = min(num_new, step.long_left)
        step.long_left -= num_new
    if num_new > step.budget and step.prefills:
        # Chunking off: a whole prompt past the budget goes first in a later step.
        return _stay_waiting(blocks, request, swapped)
    if blocks.allocate(request, num_new, reserve=config.watermark_blocks) is None:
        return _stay_waiting(blocks, request, swapped)  # give the prefix back until it fits
    if prefill_time is not None:
        prefill_time.take(start, num_new)
    if swapped:
        # Host blocks are copied back into the first new pool blocks before the forward
        # pass. They can be freed now: no swap-out follows an admission in one step.
        step.out.swap_in += zip(request.swapped_block_ids, request.block_ids)
        release_swap(scheduler.swap_space, request)
    scheduler.waiting.remove(request)
    if long:
        scheduler.long_prompts.add(request.request_id)
    else:
        scheduler.long_prompts.discard(request.request_id)
    bisect.insort(scheduler.running, request, key=running_order)
    request.status = RequestStatus.RUNNING
    if request.first_scheduled is None:
        request.first_scheduled = time.monotonic()
        scheduler.ledger.charge_input(request.tenant, len(request.prompt_token_ids),
                                      request.weight)
    # New to the worker: it learns the whole block table, cached prefix included.
    scheduler.unknown_to_workers.discard(request.request_id)
    step.prefills.append(ScheduledWork(request, start, num_new, list(request.block_ids), True))
    step.scheduled.add(request.request_id)  # the one fix since 926035e (see __init__.py)
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
