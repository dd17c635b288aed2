"""What the engine core does when its rank group fails: restart it and carry on from the KV
pool it kept, or put every live request back in line (recover); end a request that keeps
breaking it (fail_in_flight); go down after too many failed restarts and come back later
(go_down, retry_when_down); and check the block bookkeeping afterwards (self_check). No torch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tokstream.engine import pool_adoption
from tokstream.engine.messages import RequestDelta, poison_message
from tokstream.engine.request import RequestStatus
from tokstream.engine.scheduler import SchedulerOutput
from tokstream.errors import ErrorKind, ReplicaError
from tokstream.state_snapshot import ReplicaStatus

if TYPE_CHECKING:
    from tokstream.engine.core import EngineCore

log = logging.getLogger("tokstream.engine")

DOWN_RETRY_S = 10.0
"""While down, seconds between attempts to start a rank group again."""


def recover(core: EngineCore, reason: str,
            failed: SchedulerOutput | None = None) -> list[RequestDelta]:
    """The rank group failed (a rank died, hung or broke a collective) in the step failed (None:
    outside a step, e.g. scoring): tear it down and start another (the warm spare if there is
    one). Where the new group maps the old one's KV memory (a CPU pool, which outlives its
    ranks), every request keeps its blocks and the failed step runs again; otherwise every live
    request goes back in line to be re-prefilled from prompt + the tokens it already has.
    Either way streams continue at their next index; sampling is a function of (seed,
    position), so nothing changes but time. After max_recovery_attempts failures in a row the
    replica is down: every live request ends with an error delta (returned) and new ones are
    refused until retry_when_down() brings a group back."""
    started = time.monotonic()
    core.set_status(ReplicaStatus.RECOVERING, reason)
    core.event("rank_failure", "", reason=reason, pids=core.executor.pids)
    core.resuming = set(core.scheduler.requests)
    for attempt in range(1, core.config.max_recovery_attempts + 1):
        try:
            core.executor.restart()
        except ReplicaError as exc:
            core.event("restart_failed", "", reason=str(exc), attempt=attempt)
            reason = str(exc)
            continue
        kept = core.executor.pool_kept and core.scheduler.keep_pool_after_restart(failed)
        if not kept:
            core.scheduler.requeue_all()  # the pool's contents died with the ranks
        pool_adoption.follow_restart(core)
        core.restarts += 1
        core.resumed_requests += len(core.scheduler.requests)
        seconds = time.monotonic() - started
        core.recovery_seconds.append(seconds)
        core.event("restarted", "", seconds=round(seconds, 3), pids=core.executor.pids,
                    resumed=len(core.scheduler.requests), kv="kept" if kept else "recomputed")
        core.set_status(ReplicaStatus.READY, None)
        self_check(core, "recovery")
        return []
    core.scheduler.requeue_all()  # whatever group comes back later starts from nothing
    return go_down(core, reason)


def self_check(core: EngineCore, after: str, rehash: bool = True) -> list[str]:
    """Check the block bookkeeping (Scheduler.check); a finding is logged, counted and
    kept as an event: a request may be reading another's KV."""
    problems = core.scheduler.check(rehash)
    if problems:
        core.self_check_failures += 1
        log.error("block bookkeeping broken after %s: %s", after, "; ".join(problems[:5]))
        core.event("self_check_failed", "", after=after, problems=problems[:20])
    return problems


def fail_in_flight(core: EngineCore, scheduled: SchedulerOutput,
                   reason: str) -> list[RequestDelta]:
    """The step failed: each request in it failed once more in a row. One that has failed
    max_request_failures times in a row is ended with an error, so a request that breaks
    the ranks every time cannot keep the replica restarting."""
    limit = core.config.max_request_failures
    deltas = []
    for work in scheduled.work:
        request = work.request
        if request.status.is_finished:
            continue
        request.num_failures += 1
        if request.num_failures < limit:
            continue
        core.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        core.detokenizers.pop(request.request_id, None)
        core.cached_tokens.pop(request.request_id, None)
        core.event("request_failed", request.request_id, failures=request.num_failures,
                    reason=reason)
        deltas.append(RequestDelta.failure(
            request.request_id, poison_message(limit, reason), ErrorKind.USER,
            num_output_tokens=request.num_output_tokens,
            num_prompt_tokens=len(request.prompt_token_ids)))
    return deltas


def go_down(core: EngineCore, reason: str) -> list[RequestDelta]:
    core.set_status(ReplicaStatus.DOWN, reason)
    core.next_retry = time.monotonic() + DOWN_RETRY_S
    deltas = []
    for request in list(core.scheduler.requests.values()):
        core.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        core.detokenizers.pop(request.request_id, None)
        core.cached_tokens.pop(request.request_id, None)
        deltas.append(RequestDelta.failure(request.request_id, f"replica down: {reason}",
                                           ErrorKind.REPLICA,
                                           num_output_tokens=request.num_output_tokens,
                                           num_prompt_tokens=len(request.prompt_token_ids)))
    return deltas


def retry_when_down(core: EngineCore) -> None:
    """While down, try a fresh rank group now and then; back to ready when one starts."""
    if core.status != ReplicaStatus.DOWN or time.monotonic() < core.next_retry:
        return
    try:
        core.executor.restart()
    except ReplicaError as exc:
        core.next_retry = time.monotonic() + DOWN_RETRY_S
        core.event("restart_failed", "", reason=str(exc), attempt=0)
        return
    pool_adoption.follow_restart(core)
    core.restarts += 1
    core.event("restarted", "", seconds=None, pids=core.executor.pids, resumed=0)
    core.set_status(ReplicaStatus.READY, None)
