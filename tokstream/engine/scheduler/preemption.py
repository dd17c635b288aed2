"""Preemption: when the pool runs dry mid-generation, the lowest-priority, latest-arrived running
request not yet given work this step gives up its blocks and goes back to the front of the
line. It is recomputed from prompt + output later, or, in swap mode, its blocks are copied to
host memory first and copied back on re-admission. Either way its stream is unchanged. Pure
Python, no torch.
"""

from __future__ import annotations

from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.output import SchedulerOutput
from tokstream.engine.scheduler.step_draft import StepDraft
from tokstream.engine.scheduler.waiting_queue import WaitingQueue


class Preemption:
    """Makes room in the pool for a running request's next tokens by preempting others."""

    def __init__(self, blocks: BlockManager, swap_space: SwapSpace | None,
                 running: list[Request], waiting: WaitingQueue, forgotten_ids: list[str]):
        self.blocks = blocks
        self.swap_space = swap_space
        """Host blocks for swap-mode preemption; None means recompute only."""
        self.running = running
        """The scheduler's running requests, in running order: victims come from the end."""
        self.waiting = waiting
        self.forgotten_ids = forgotten_ids
        """The scheduler's list of requests the workers should drop at the next step."""
        self.num_preemptions = 0
        self.num_swap_outs = 0
        """Of the preemptions, those that kept their KV in host memory."""

    def allocate_or_preempt(self, request: Request, num_new: int,
                            step: StepDraft) -> list[int] | None:
        """request's new blocks for num_new more tokens, preempting until they fit; None when
        request itself was preempted, or when, still running, it is alone and too big for the
        whole pool (it can never continue: the caller ends it)."""
        while True:
            new_blocks = self.blocks.allocate(request, num_new)
            if new_blocks is not None:
                return new_blocks
            # The least important request not yet given work this step (request itself at
            # the latest).
            victim = next(r for r in reversed(self.running)
                          if r.request_id not in step.scheduled)
            if victim is request and len(self.running) == 1:
                return None
            self.preempt(victim, step.out)
            if victim is request:
                return None

    def preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if self._swap_out(request, out):
            self.num_swap_outs += 1
        else:
            self.blocks.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)
        self.forgotten_ids.append(request.request_id)
        out.preempted.append(request)

    def _swap_out(self, request: Request, out: SchedulerOutput) -> bool:
        """Free request's pool blocks but keep their content in host blocks; False (recompute)
        when swap is off or the host blocks are short."""
        num_blocks = self.blocks.blocks_for(request.num_computed_tokens)
        if self.swap_space is None or num_blocks == 0:
            return False
        host_ids = self.swap_space.allocate(num_blocks)
        if host_ids is None:
            return False
        # The worker copies these out before the step's forward pass, so the freed pool blocks
        # may be handed to another request in this same step.
        out.swap_out += zip(request.block_ids[:num_blocks], host_ids)
        computed = request.num_computed_tokens
        self.blocks.free(request)
        request.num_computed_tokens = computed
        request.swapped_block_ids = host_ids
        return True


def release_swap(swap_space: SwapSpace | None, request: Request) -> None:
    """Free request's host blocks, if it holds any: copied back, or of no use any more."""
    if request.swapped_block_ids:
        swap_space.free(request.swapped_block_ids)
        request.swapped_block_ids = []
