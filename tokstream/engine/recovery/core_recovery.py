"""What the engine core does when its rank group fails: restart it and carry on from the KV pool
it kept, or put every live request back in line (recover); end a request that keeps breaking it
(fail_step); go down after too many failed restarts and come back later (retry_when_down); and
check the block bookkeeping afterwards (self_check). No torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tokstream import envs
from tokstream.engine.messages.gateway import StatusChanged
from tokstream.engine.messages.request import RequestDelta, poison_message
from tokstream.engine.recovery.pool_adoption import PoolAdoption
from tokstream.engine.request import Request, RequestStatus
from tokstream.errors import ErrorKind, ReplicaError
from tokstream.state_snapshot import ReplicaStatus

if TYPE_CHECKING:
    from tokstream.config import EngineConfig
    from tokstream.engine.block_manager import BlockManager
    from tokstream.engine.executor import Executor
    from tokstream.engine.scheduler.output import SchedulerOutput
    from tokstream.engine.scheduler.scheduler import Scheduler
    from tokstream.engine.step_record import StepRecord

log = logging.getLogger("tokstream.engine")

DOWN_RETRY_S = 10.0
"""While down, seconds between attempts to start a rank group again."""


class CoreRecovery:
    """The engine core's recovery from rank-group failures, and everything it counts: the
    replica's status, restarts, resumed requests and their seconds, the retry while down, the
    self-check's findings, and the deltas a recovery outside a step leaves for the next one.
    The core keeps the loop and calls in here; this reads the executor, the scheduler and the
    block manager, and reaches back only through event and forget."""

    def __init__(self, config: EngineConfig, executor: Executor, scheduler: Scheduler,
                 block_manager: BlockManager, event: Callable[..., None],
                 forget: Callable[[str], None]):
        self.config = config
        self.executor = executor
        self.scheduler = scheduler
        self.event = event
        """The core's event log (EngineCore.event)."""
        self.forget = forget
        """Drops the core's output state (detokenizer, cached-token count) of a request this
        ended."""
        self.pool = PoolAdoption(executor, block_manager, config.model, event)
        self.status = ReplicaStatus.READY
        """ready | recovering | down (see recover())."""
        self.on_status: Callable[[StatusChanged], None] | None = None
        """Called with a StatusChanged whenever the status changes (the core process forwards
        it to the gateway)."""
        self.resuming: set[str] = set()
        """Requests put back in line by the last rank-group restart that have not produced a
        token since; the snapshot shows them as recovering."""
        self.restarts = 0
        self.resumed_requests = 0
        self.recovery_seconds: list[float] = []
        self.pending_deltas: list[RequestDelta] = []
        """Deltas produced outside step() (a recovery during a score pass), sent with the next
        step's."""
        self.next_retry = 0.0
        self.self_check_failures = 0
        """Self-checks of the block bookkeeping that found something (see self_check)."""
        self.check_every_step = envs.SELF_CHECK.is_set()
        self.step_record: StepRecord | None = None
        """Where the gateway reads which requests a step computes if this core dies in it
        (engine/step_record.py; None: in process, nobody reads it)."""

    # --- the status and what the gateway is told of it ---------------------------------------

    def set_status(self, status: ReplicaStatus, reason: str | None) -> None:
        self.status = status
        if self.on_status is not None:
            self.on_status(StatusChanged(
                status, reason, restarts=self.restarts, worker_pids=self.executor.pids,
                resumed_requests=self.resumed_requests, recoveries=len(self.recovery_seconds),
                recovery_s=self.recovery_seconds[-1] if self.recovery_seconds else None))

    def adopt_pool(self) -> tuple[int, str | None]:
        """Claim the pool files' block index (PoolAdoption.adopt)."""
        return self.pool.adopt()

    # --- around each step ---------------------------------------------------------------------

    def take_pending(self) -> list[RequestDelta]:
        deltas, self.pending_deltas = self.pending_deltas, []
        return deltas

    def reload_spare_once_resumed(self) -> None:
        """Before a step: once every request the last restart put back in line has its next
        token (or is gone), the executor loads its standby group again."""
        self.resuming.intersection_update(self.scheduler.requests)
        if not self.resuming:
            self.executor.reload_spare()  # only now: its loading would slow their re-prefill

    @contextmanager
    def recording(self, scheduled: SchedulerOutput) -> Iterator[None]:
        """The step's requests are in the step record while it runs."""
        record = self.step_record
        if record is not None:
            record.begin([work.request.request_id for work in scheduled.work])
        try:
            yield
        finally:
            if record is not None:
                record.end()

    def produced(self, advanced: Iterable[Request]) -> None:
        """The step gave these requests a token."""
        # A failure streak ends at a token, as the gateway counts core deaths: a prefill chunk
        # that ran proves nothing, and a resumed request keeps its last-chance isolation (no
        # other suspect in its steps) until it has produced one.
        for request in advanced:
            request.num_failures = 0
            self.resuming.discard(request.request_id)

    # --- a failed step, a failure outside one -------------------------------------------------

    def fail_step(self, scheduled: SchedulerOutput, reason: str) -> list[RequestDelta]:
        """The rank group failed in the step: settle the requests it was computing, then
        recover the group."""
        return self.fail_in_flight(scheduled, reason) + self.recover(reason, scheduled)

    def recover_between_steps(self, reason: str) -> None:
        """The rank group failed outside a step (a score pass): recover, and send what that
        ended with the next step's deltas."""
        self.pending_deltas += self.recover(reason)

    def recover(self, reason: str, failed: SchedulerOutput | None = None) -> list[RequestDelta]:
        """The rank group failed (a rank died, hung or broke a collective) in the step failed
        (None: outside a step, e.g. scoring): tear it down and start another (the warm spare if
        there is one). Where the new group maps the old one's KV memory (a CPU pool, which
        outlives its ranks), every request keeps its blocks and the failed step runs again;
        otherwise every live request goes back in line to be re-prefilled from prompt + the
        tokens it already has. Either way streams continue at their next index; sampling is a
        function of (seed, position), so nothing changes but time. After
        max_recovery_attempts failures in a row the replica is down: every live request ends
        with an error delta (returned) and new ones are refused until retry_when_down() brings
        a group back."""
        started = time.monotonic()
        executor, scheduler = self.executor, self.scheduler
        self.set_status(ReplicaStatus.RECOVERING, reason)
        self.event("rank_failure", "", reason=reason, pids=executor.pids)
        self.resuming = set(scheduler.requests)
        for attempt in range(1, self.config.max_recovery_attempts + 1):
            try:
                executor.restart()
            except ReplicaError as exc:
                self.event("restart_failed", "", reason=str(exc), attempt=attempt)
                reason = str(exc)
                continue
            kept = executor.pool_kept and scheduler.keep_pool_after_restart(failed)
            if not kept:
                scheduler.requeue_all()  # the pool's contents died with the ranks
            self.pool.follow_restart()
            self.restarts += 1
            self.resumed_requests += len(scheduler.requests)
            seconds = time.monotonic() - started
            self.recovery_seconds.append(seconds)
            self.event("restarted", "", seconds=round(seconds, 3), pids=executor.pids,
                       resumed=len(scheduler.requests), kv="kept" if kept else "recomputed")
            self.set_status(ReplicaStatus.READY, None)
            self.self_check("recovery")
            return []
        scheduler.requeue_all()  # whatever group comes back later starts from nothing
        return self.go_down(reason)

    def fail_in_flight(self, scheduled: SchedulerOutput, reason: str) -> list[RequestDelta]:
        """The step failed: each request in it failed once more in a row. One that has failed
        max_request_failures times in a row is ended with an error, so a request that breaks
        the ranks every time cannot keep the replica restarting."""
        limit = self.config.max_request_failures
        deltas = []
        for work in scheduled.work:
            request = work.request
            if request.status.is_finished:
                continue
            request.num_failures += 1
            if request.num_failures < limit:
                continue
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.forget(request.request_id)
            self.event("request_failed", request.request_id, failures=request.num_failures,
                       reason=reason)
            deltas.append(RequestDelta.failure(
                request.request_id, poison_message(limit, reason), ErrorKind.USER,
                num_output_tokens=request.num_output_tokens,
                num_prompt_tokens=len(request.prompt_token_ids)))
        return deltas

    # --- down, and back -----------------------------------------------------------------------

    def go_down(self, reason: str) -> list[RequestDelta]:
        self.set_status(ReplicaStatus.DOWN, reason)
        self.next_retry = time.monotonic() + DOWN_RETRY_S
        deltas = []
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.forget(request.request_id)
            deltas.append(RequestDelta.failure(request.request_id, f"replica down: {reason}",
                                               ErrorKind.REPLICA,
                                               num_output_tokens=request.num_output_tokens,
                                               num_prompt_tokens=len(request.prompt_token_ids)))
        return deltas

    def retry_when_down(self) -> None:
        """While down, try a fresh rank group now and then; back to ready when one starts."""
        if self.status != ReplicaStatus.DOWN or time.monotonic() < self.next_retry:
            return
        try:
            self.executor.restart()
        except ReplicaError as exc:
            self.next_retry = time.monotonic() + DOWN_RETRY_S
            self.event("restart_failed", "", reason=str(exc), attempt=0)
            return
        self.pool.follow_restart()
        self.restarts += 1
        self.event("restarted", "", seconds=None, pids=self.executor.pids, resumed=0)
        self.set_status(ReplicaStatus.READY, None)

    # --- the bookkeeping's self-check ---------------------------------------------------------

    def self_check(self, after: str, rehash: bool = True) -> list[str]:
        """Check the block bookkeeping (Scheduler.check); a finding is logged, counted and
        kept as an event: a request may be reading another's KV."""
        problems = self.scheduler.check(rehash)
        if problems:
            self.self_check_failures += 1
            log.error("block bookkeeping broken after %s: %s", after, "; ".join(problems[:5]))
            self.event("self_check_failed", "", after=after, problems=problems[:20])
        return problems
