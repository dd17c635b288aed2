"""The /v1/state snapshot: the engine core's own (KV, batch, its rows and events) joined with
what only the gateway knows (streams, admission, tenants, replica status and restarts, ranks'
and processes' memory). Built as tokstream.state_snapshot's classes, the ones top and chaos
parse it with."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Protocol

from tokstream.core_state import CoreSnapshot, Kv, LastStep, Speculation
from tokstream.server.operations import host_stats
from tokstream.state_snapshot import (BATCH_FROM_CORE, AdmissionState, Batch, ProcessInfo, Rank,
                                      Replica, RequestRow, StateSnapshot, TenantRow, Timing)

if TYPE_CHECKING:
    from tokstream.engine.async_engine import AsyncEngine
    from tokstream.server.access.gateway_admission import Admission
    from tokstream.server.access.tenants import Tenants
    from tokstream.server.operations.events import EventLog
    from tokstream.server.replica.supervisor import EngineSupervisor
    from tokstream.server.streaming.streams import StreamRegistry
    from tokstream.state_snapshot import ReplicaStatus


class ServerView(Protocol):
    """What the snapshot reads of the gateway's hub (server.py's Server)."""

    engine: AsyncEngine
    registry: StreamRegistry
    supervisor: EngineSupervisor
    status: ReplicaStatus
    model_id: str
    max_model_len: int
    started: float
    admission: Admission
    tenants: Tenants | None
    events: EventLog

    async def core_snapshot(self) -> dict | None: ...


class GatewaySnapshot:
    def __init__(self):
        self.usage = host_stats.ProcessUsage()

    async def build(self, server: ServerView) -> StateSnapshot:
        waited = time.perf_counter()
        core = await server.core_snapshot()
        started = time.perf_counter()
        snapshot = self._join(server, CoreSnapshot.from_wire(core or {}))
        snapshot.timing = Timing(core_wait_ms=(started - waited) * 1000,
                                 gateway_build_ms=(time.perf_counter() - started) * 1000)
        return snapshot

    def _join(self, server: ServerView, core: CoreSnapshot) -> StateSnapshot:
        now = time.monotonic()
        engine = server.engine
        engine_rows = {row.id: row for row in core.requests}
        requests = [_request_row(stream, engine_rows.get(stream.request_id), now)
                    for stream in server.registry.streams.values()]
        last = core.last_step or LastStep()
        # The current group's ranks (the core's snapshot may predate a restart).
        worker_pids = engine.info.get("worker_pids") or core.worker_pids
        roles = ([("gateway", os.getpid()), ("engine", engine.pid)]
                 + [(f"rank{rank}", pid) for rank, pid in enumerate(worker_pids)])
        usage = self.usage.measure([pid for _, pid in roles])
        recovery = server.supervisor.recovery
        for event in core.events:
            event.extra["source"] = "engine"
        return StateSnapshot(
            replica=Replica(
                status=server.status, restarts=recovery.total_restarts,
                restarts_by_kind=dict(recovery.restarts),
                resumed_requests=dict(recovery.resumed_requests),
                recovery_s={k: list(v) for k, v in recovery.recovery_seconds.items()},
                model=server.model_id, dtype=engine.info.get("dtype"),
                device=engine.config.device, tp=engine.config.tp, spare=engine.config.spare,
                max_model_len=server.max_model_len, uptime_s=time.time() - server.started,
                error=engine.dead),
            ranks=[Rank(rank=rank, pid=pid, alive=host_stats.alive(pid), **usage[pid])
                   for rank, pid in enumerate(worker_pids)],
            kv=core.kv if core.kv is not None else Kv.from_wire({}),
            batch=Batch(running=core.running, waiting=core.waiting,
                        max_num_seqs=core.max_num_seqs, token_budget=core.token_budget,
                        last_step_tokens=last.num_tokens, last_step_seqs=last.num_seqs,
                        last_step_ms=last.step_ms, step_id=core.step_id,
                        num_preemptions=core.num_preemptions,
                        **{key: core.extra[key] for key in BATCH_FROM_CORE
                           if key in core.extra}),
            speculation=(core.speculation if core.speculation is not None
                         else Speculation.from_wire({})),
            admission=AdmissionState.from_wire(server.admission.snapshot()),
            requests=requests,
            tenants=([TenantRow.from_wire(t.row()) for t in server.tenants.tenants]
                     if server.tenants else []),
            fairness=core.tenants,
            events=server.events.merged(core.events),
            engine=ProcessInfo(pid=engine.pid, alive=host_stats.alive(engine.pid)),
            gateway=ProcessInfo(pid=os.getpid()),
            memory=host_stats.memory(roles, usage, engine.config.device))


def _request_row(stream, core_row, now: float) -> RequestRow:
    if core_row is None:
        state = "finishing" if stream.final else "submitted"
        return RequestRow(**vars(stream.row(now)), state=state, phase=state)
    return RequestRow(**vars(stream.row(now)), state=core_row.state, blocks=core_row.blocks,
                      preemptions=core_row.preemptions, computed_tokens=core_row.computed_tokens,
                      phase=core_row.phase if core_row.phase is not None else core_row.state,
                      draft_tokens=core_row.draft_tokens,
                      accepted_tokens=core_row.accepted_tokens, priority=core_row.priority,
                      background=core_row.background)
