"""The engine core's state as plain data for /v1/state: scheduler, KV pool and block map,
requests, tenants, events, pids. No torch.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.prefill_policy import is_prefilling

if TYPE_CHECKING:
    from tokstream.config import EngineConfig
    from tokstream.engine.block_manager import BlockManager, SwapSpace
    from tokstream.engine.executor import Executor
    from tokstream.engine.recovery.core_recovery import CoreRecovery
    from tokstream.engine.scheduler.scheduler import Scheduler
    from tokstream.engine.speculation import Speculator

REF_COUNT_CHARS = "0123456789"


@dataclass
class StepStats:
    """The last step's size and time."""

    num_tokens: int
    num_seqs: int
    step_s: float


class CoreState(Protocol):
    """What the snapshot reads of the engine core (EngineCore)."""

    config: EngineConfig
    scheduler: Scheduler
    block_manager: BlockManager
    swap_space: SwapSpace | None
    speculator: Speculator | None
    executor: Executor
    recovery: CoreRecovery
    step_id: int
    prefill_tokens_total: int
    decode_tokens_total: int
    last_step: StepStats | None
    events: deque[dict]


def snapshot(core: CoreState) -> dict:
    """Plain-data state for /v1/state: scheduler, block map, requests, events, pids."""
    now = time.monotonic()
    scheduler, blocks, recovery = core.scheduler, core.block_manager, core.recovery
    sched = core.config.scheduler
    requests = []
    for request in scheduler.requests.values():
        requests.append({
            "id": request.request_id, "state": request.status.name.lower(),
            "phase": phase(recovery.resuming, request),
            "tenant": request.tenant, "priority": request.priority,
            "background": request.background,
            "prompt_tokens": len(request.prompt_token_ids),
            "output_tokens": request.num_output_tokens,
            "computed_tokens": request.num_computed_tokens,
            "blocks": len(request.block_ids), "preemptions": request.num_preemptions,
            "swapped_blocks": len(request.swapped_block_ids),
            "age_s": now - request.arrival,
            "queue_s": (request.first_scheduled - request.arrival
                        if request.first_scheduled is not None else None),
            **(core.speculator.request_counts(request.request_id)
               if core.speculator is not None else {})})
    last = core.last_step
    return {
        "pid": os.getpid(),
        "status": recovery.status,
        "restarts": recovery.restarts,
        "resumed_requests": recovery.resumed_requests,
        "recovery_s": recovery.recovery_seconds[-1] if recovery.recovery_seconds else None,
        "worker_alive": core.executor.alive(),
        "worker_pids": core.executor.pids,
        "step_id": core.step_id,
        "last_step": ({"num_tokens": last.num_tokens, "num_seqs": last.num_seqs,
                       "step_ms": last.step_s * 1000} if last else None),
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "max_num_seqs": core.config.scheduler.max_num_seqs,
        "token_budget": sched.max_num_batched_tokens,
        "chunked_prefill": sched.chunked_prefill,
        # Most prompt tokens of one request per step; None: prompts go whole.
        "max_prefill_chunk": ((sched.max_prefill_chunk or sched.max_num_batched_tokens)
                              if sched.chunked_prefill else None),
        "num_preemptions": scheduler.num_preemptions,
        "prefill_tokens_total": core.prefill_tokens_total,
        "decode_tokens_total": core.decode_tokens_total,
        "preemption_mode": core.config.cache.preemption_mode,
        "num_swap_preemptions": scheduler.num_swap_outs,
        "kv": {"block_size": blocks.block_size, "num_blocks": blocks.num_blocks,
               "free_blocks": blocks.num_free_blocks, "used_blocks": blocks.num_used_blocks,
               "cached_blocks": blocks.num_cached_blocks, "usage": blocks.usage,
               "prefix_cache_queries": blocks.prefix_queries,
               "prefix_cache_hits": blocks.prefix_hits,
               "swap_blocks": core.swap_space.num_blocks if core.swap_space else 0,
               "free_swap_blocks": (core.swap_space.num_free_blocks
                                    if core.swap_space else 0),
               "block_map": block_map(blocks, scheduler),
               # Problems the bookkeeping has now (none when sound), and how many
               # self-checks since the start found any.
               "self_check": core.scheduler.check(rehash=False),
               "self_check_failures": recovery.self_check_failures},
        "speculation": (core.speculator.snapshot() if core.speculator is not None
                        else {"method": "off"}),
        "requests": requests,
        "tenants": scheduler.ledger.snapshot(),
        "policy": core.config.scheduler.policy,
        "prefill_policy": prefill_policy(scheduler),
        "events": list(core.events),
    }


def prefill_policy(scheduler: Scheduler) -> dict:
    """The two latency classes now (prefill_policy.py): the settings, the long prefills' share
    of the prefill time over the last second, whether they go first (owed their share) or are
    held back behind short prompts, and each long prefill."""
    config, policy = scheduler.config, scheduler.prefill_policy
    short_waiting = any(not policy.is_long(r) for r in scheduler.waiting) or any(
        is_prefilling(r) and not policy.is_long(r) for r in scheduler.running)
    held = not policy.long_first and short_waiting
    long_step_ms = (policy.long_step_ms if config.itl_target_ms and config.chunked_prefill
                    else None)
    return {
        "long_prefill_tokens": config.long_prefill_tokens,
        "long_prefill_share": config.long_prefill_share,
        # The step time a long chunk is held to (None: the ITL target is off).
        "long_step_ms": long_step_ms,
        "long_share": policy.long_share.share,
        "long_first": policy.long_first,
        "long_prefill_alone": policy.steps_apart,
        "long_prefills": [
            {"id": r.request_id, "tenant": r.tenant, "prompt_tokens": len(r.prompt_token_ids),
             "left_tokens": r.num_tokens - r.num_computed_tokens,
             "state": r.status.name.lower(), "held": held}
            for r in list(scheduler.running) + list(scheduler.waiting) if policy.is_long(r)],
    }


def phase(resuming: set[str], request: Request) -> str:
    """waiting | prefill | decode | preempted | recovering: where a request is in its life.
    A running request decodes once every token but the newest sampled one is in the
    cache; one re-prefilling after a rank-group restart is recovering."""
    if request.request_id in resuming:
        return "recovering"
    if request.status != RequestStatus.RUNNING:
        return request.status.name.lower()
    return "prefill" if request.num_computed_tokens < request.num_tokens - 1 else "decode"


def block_map(blocks: BlockManager, scheduler: Scheduler) -> dict:
    """Compact per-block map: one character per block for its reference count ('0'-'9',
    '+' past 9); per owner, its block ids as [first, count] runs; and the blocks that hold
    a cached prefix (held or evictable) as runs."""
    ref_counts = "".join(REF_COUNT_CHARS[c] if c < 10 else "+"
                         for c in blocks.ref_counts)
    owners = {request.request_id: _runs(request.block_ids) for request in scheduler.running}
    return {"ref_counts": ref_counts, "owners": owners, "cached": blocks.cached_runs}


def _runs(block_ids: list[int]) -> list[list[int]]:
    """Block ids as [first, count] runs of consecutive ids, in order."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return runs
