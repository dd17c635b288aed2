"""The engine core in its own process, talking over a pipe in the messages of
tokstream.engine.messages.gateway (a Ready or StartFailed first, then the others).

State and score queries are answered between steps, so a reply waits at most one step.
The core exits when the pipe closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

from tokstream import envs, gc_policy
from tokstream.config import EngineConfig
from tokstream.engine.child_process import become_child
from tokstream.engine.heartbeat import start_beating
from tokstream.engine.step_record import StepRecord
from tokstream.engine.messages.gateway import (Abort, Add, AdoptPool, ArmSpare, Batch, CoreDead,
                                               Deltas, PoolAdopted, ProtocolError, Ready,
                                               ScoreQuery, ScoreReply, Shutdown, StartFailed,
                                               StateQuery, StateReply)
from tokstream.engine.messages.request import RequestDelta
from tokstream.engine.messages.start_times import StartTimes
from tokstream.engine.recovery.pool_files import PoolPaths
from tokstream.errors import (ErrorKind, OverloadedError, ReplicaError, TokstreamError,
                              UserInputError, error_kind)
from tokstream.state_snapshot import ReplicaStatus

IDLE_POLL_S = 0.5
GATHER_LIMIT = 5
"""An idle core reads a burst of arrivals for at most this many gather windows
(SchedulerConfig.arrival_gather_ms), so arrivals that never pause cannot hold it idle."""


def core_main(conn, config: EngineConfig, parent_pid: int, run_dir: str | None = None,
              spawned_at: float | None = None, pool: PoolPaths | None = None,
              heartbeat=None, step_record=None) -> None:
    """The core's process: dies with the gateway and leaves SIGTERM to it (child_process);
    its rank groups keep their files under run_dir, which the gateway removes. spawned_at:
    the gateway's time.monotonic() as it started this process. pool: the gateway's KV pool
    files (engine/recovery/pool_files.py; None: the core makes its own). heartbeat: the counter this
    process bumps for as long as it runs (engine/heartbeat.py; None: nobody watches).
    step_record: where it writes the requests of the step it computes (engine/step_record.py)."""
    entered = time.monotonic()
    become_child(parent_pid)
    if heartbeat is not None:
        start_beating(heartbeat)
    if run_dir is not None:
        # Every temporary file of this core and its ranks (the forkserver's socket folder
        # among them) goes in the folder the gateway removes, even after its own SIGKILL
        # (engine/janitor.py).
        os.environ["TMPDIR"] = tempfile.tempdir = run_dir
    logging.basicConfig(level=envs.LOG.get(),
                        format="%(asctime)s %(name)s: %(message)s")
    from tokstream.engine.rank_start import rank_context

    rank_context(config)  # the ranks' forkserver preloads while this core loads its own
    from tokstream.engine.core import EngineCore

    imported = time.monotonic()
    try:
        core = EngineCore(config, run_dir=run_dir, pool=pool)
    except TokstreamError as exc:
        kind = ErrorKind.USER if isinstance(exc, UserInputError) else ErrorKind.REPLICA
        conn.send(StartFailed(kind, str(exc)))
        return
    if step_record is not None:
        core.recovery.step_record = StepRecord(step_record)
    conn.send(Ready(
        start_times=_start_times(core.executor.group, spawned_at or entered, entered, imported),
        model=core.model_config.name, dtype=core.dtype, weights=core.weights, pid=os.getpid(),
        worker_pids=core.executor.pids, num_blocks=core.block_manager.num_blocks,
        block_size=core.block_manager.block_size, max_model_len=core.max_model_len,
        vocab_size=core.model_config.vocab_size, capacity=core.capacity_summary()))
    core.recovery.on_status = conn.send
    gc_policy.settle_after_start()
    try:
        _serve(conn, core, config.scheduler.arrival_gather_ms / 1000)
    except (EOFError, OSError):
        pass  # the client went away
    except ReplicaError as exc:
        live = list(core.scheduler.requests)
        deltas = [RequestDelta.failure(rid, str(exc), ErrorKind.REPLICA) for rid in live]
        try:
            conn.send(Deltas(deltas))
            conn.send(CoreDead(str(exc)))
        except OSError:
            pass
    finally:
        core.shutdown()


def _start_times(group, spawned_at: float, entered: float, imported: float) -> StartTimes:
    now = time.monotonic()
    load_s = max(ready.load_s for ready in group.ready)
    return StartTimes(spawn_s=entered - spawned_at, imports_s=imported - entered,
                      model_s=group.spawned_at - imported,
                      ranks_start_s=group.ready_at - group.spawned_at - load_s,
                      ranks_load_s=load_s, rest_s=now - group.ready_at, total_s=now - spawned_at)


def _serve(conn, core, gather_s: float = 0.0) -> None:
    """The core's loop: read what has arrived, step, send the deltas. gather_s: how long an
    idle core keeps reading a burst of arrivals before its first step (SchedulerConfig)."""
    while True:
        idle = not core.has_work
        timeout = IDLE_POLL_S if idle else 0
        gather_until = None
        out: list[RequestDelta] = []
        while conn.poll(timeout):
            received = conn.recv()
            # A batch (AsyncEngine.batch: a new core's resumed requests) is read at once, so
            # its requests share the next step instead of arriving one pipe read at a time.
            for message in received.messages if isinstance(received, Batch) else [received]:
                if _handle(conn, core, message, out):
                    return
            timeout = 0
            if idle and gather_s and core.has_work:
                # Work has just arrived: read on while the burst keeps coming.
                now = time.monotonic()
                gather_until = gather_until or now + GATHER_LIMIT * gather_s
                timeout = max(0.0, min(gather_s, gather_until - now))
        if core.has_work or core.status == ReplicaStatus.DOWN or core.pending_deltas:
            out.extend(core.step())
        elif core.status == ReplicaStatus.READY:
            core.executor.reload_spare()  # idle: nothing left to re-prefill (see step)
        if out:
            conn.send(Deltas(out))


def _handle(conn, core, message, out: list[RequestDelta]) -> bool:
    """Act on one message from the client; True when it asks the core to stop."""
    match message:
        case Shutdown():
            return True
        case Add(request):
            try:
                core.add_request(request)
            except (UserInputError, OverloadedError) as exc:
                out.append(RequestDelta.failure(request.request_id, str(exc), error_kind(exc)))
        case ArmSpare():
            core.executor.arm_spare()
        case Abort(request_id):
            delta = core.abort(request_id)
            if delta is not None:
                out.append(delta)
        case StateQuery(token):
            conn.send(StateReply(token, core.snapshot()))
        case AdoptPool(token):
            conn.send(PoolAdopted(token, *core.recovery.adopt_pool()))
        case ScoreQuery(token, token_ids, start):
            conn.send(_score(core, token, token_ids, start))
        case _:  # a Batch inside a Batch included
            raise ProtocolError("engine core", message)
    return False


def _score(core, token: int, token_ids: list[int], start: int) -> ScoreReply:
    """The reply to a score query; replica failures propagate."""
    try:
        result = core.score(token_ids, start)
    except UserInputError as exc:
        return ScoreReply(token, None, ErrorKind.USER, str(exc))
    except OverloadedError as exc:
        return ScoreReply(token, None, ErrorKind.OVERLOADED, str(exc))
    if result.error is not None:  # the workers' pass failed (the replica itself is fine)
        return ScoreReply(token, None, ErrorKind.REPLICA, result.error)
    return ScoreReply(token, result)
