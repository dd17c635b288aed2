"""Preemption: when the pool runs dry mid-generation, the lowest-priority, latest-arrived running
request not yet given work this step gives up its blocks and goes back to the front of the
line. It is recomputed from prompt + output later, or, in swap mode, its blocks are copied to
host memory first and copied back on re-admission. Either way its stream is unchanged. Pure
Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.output import SchedulerOutput
from old_scheduler.step_draft import StepDraft

if TYPE_CHECKING:
    from old_scheduler.scheduler import Scheduler


def allocate_or_preempt(scheduler: Scheduler, request: Request, num_new: int,
                        step: StepDraft) -> list[int] | None:
    """request's new blocks for num_new more tokens, preempting until they fit; None when
    request itself was preempted, or ended (too big for the whole pool)."""
    while True:
        new_blocks = scheduler.block_manager.allocate(request, num_new)
        if new_blocks is not None:
            return new_blocks
        # The least important request not yet given work this step (request itself at
        # the latest).
        victim = next(r for r in reversed(scheduler.running)
                      if r.request_id not in step.scheduled)
        if victim is request and len(scheduler.running) == 1:
            # Alone and still too big for the whole pool: it can never continue.
            scheduler.finish(request, RequestStatus.FINISHED_LENGTH, "kv_cache_capacity")
            step.out.finished.append(request)
            return None
        preempt(scheduler, victim, step.out)
        if victim is request:
            return None


def preempt(scheduler: Scheduler, request: Request, out: SchedulerOutput) -> None:
    scheduler.running.remove(request)
    if swap_out(scheduler.block_manager, scheduler.swap_space, request, out):
        scheduler.num_swap_outs += 1
    else:
        scheduler.block_manager.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.push_front(request)
    scheduler.forgotten_ids.append(request.request_id)
    out.preempted.append(request)


def swap_out(block_manager: BlockManager, swap_space: SwapSpace | None, request: Request,
             out: SchedulerOutput) -> bool:
    """Free request's pool blocks but keep their content in host blocks; False (recompute)
    when swap is off or the host blocks are short."""
    num_blocks = block_manager.blocks_for(request.num_computed_tokens)
    if swap_space is None or num_blocks == 0:
        return False
    host_ids = swap_space.allocate(num_blocks)
    if host_ids is None:
        return False
    # The worker copies these out before the step's forward pass, so the freed pool blocks
    # may be handed to another request in this same step.
    out.swap_out += zip(request.block_ids[:num_blocks], host_ids)
    computed = request.num_computed_tokens
    block_manager.free(request)
    request.num_computed_tokens = computed
    request.swapped_block_ids = host_ids
    return True


def release_swap(swap_space: SwapSpace | None, request: Request) -> None:
    """Free request's host blocks, if it holds any: copied back, or of no use any more."""
    if request.swapped_block_ids:
        swap_space.free(request.swapped_block_ids)
        request.swapped_block_ids = []
