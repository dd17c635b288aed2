"""The async engine API the server uses: submit a request, receive its deltas, abort it, ask
the core for a state snapshot or a score pass.

The engine core runs in a child process; the two talk in the messages of
tokstream.engine.messages.gateway over a CorePipe, which never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable

import psutil

from tokstream.config import EngineConfig
from tokstream.engine.core_pipe import CorePipe
from tokstream.engine.core_process import core_main
from tokstream.engine.step_record import in_flight, new_record
from tokstream.engine.janitor import JANITOR, make_core_folder
from tokstream.engine.heartbeat import BEAT_INTERVAL_S, HeartbeatWatch, silence_limit_s
from tokstream.engine.messages.gateway import (Abort, Add, AdoptPool, ArmSpare, CoreDead,
                                               CoreMessage, Deltas, PoolAdopted, ProtocolError,
                                               Ready, ScoreQuery, ScoreReply, Shutdown,
                                               StartFailed, StateQuery, StateReply, StatusChanged)
from tokstream.engine.messages.request import EngineRequest, RequestDelta
from tokstream.engine.messages.worker import ScoreResult
from tokstream.engine.recovery.pool_files import PoolFiles
from tokstream.errors import ErrorKind, OverloadedError, ReplicaError, UserInputError
from tokstream.process_end import wait_ended
from tokstream.state_snapshot import ReplicaStatus

log = logging.getLogger("tokstream.engine")

DeltaSink = Callable[[RequestDelta], None]
"""Called on the event loop thread with each delta of one request, in order."""
SCORE_ERRORS = {ErrorKind.USER: UserInputError, ErrorKind.OVERLOADED: OverloadedError,
                ErrorKind.REPLICA: ReplicaError}
"""What a failed score pass raises, by its reply's error kind."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, pool: PoolFiles | None = None):
        self.config = config
        self.pool = pool
        """The KV pool files its ranks map, held by the caller so that they outlive this core
        (None: the core makes its own)."""
        self.info: dict = {}
        self.dead: str | None = None
        self._sinks: dict[str, DeltaSink] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._pipe: CorePipe | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.replica_status = ReplicaStatus.READY
        """ready | recovering | down, as the core last reported (see CoreRecovery.recover)."""
        self.restarts = 0
        """Rank-group restarts this core has done."""
        self.resumed_requests = 0
        """Requests this core put back in line after its rank-group restarts."""
        self.recovery_seconds: list[float] = []
        self.keep_requests_on_death = False
        """Set by an owner that resumes the live requests on a new engine after a death (the
        gateway's supervisor): the sinks then get no error delta, and are simply dropped."""
        self.on_status: Callable[[ReplicaStatus, str | None], None] | None = None
        """Called on the event loop thread with (status, reason) when the replica's status
        changes."""
        self.on_dead: Callable[[str], None] | None = None
        """Called on the event loop thread once, when the core process is found dead."""
        self.run_dir: str | None = None
        """The core's folder for its rank groups' files; removed at shutdown."""
        self._ranks: list[psutil.Process] = []
        """The core's ranks as last reported (psutil checks identity before a kill)."""
        self._step_record = None
        """The shared step record the core writes (engine/step_record.py)."""
        self._heartbeat = None
        """The counter the core bumps while it runs (engine/heartbeat.py)."""
        self.process = None
        """The core's process, from launch()."""
        self._watch: asyncio.Task | None = None
        """The heartbeat watch, from Ready until the core is dead or shut down."""

    def launch(self) -> "AsyncEngine":
        """Start the core's process and return at once; start() waits for it to be ready.
        Launched early, it starts while its caller does other work: a core's start is mostly
        its ranks' forkserver importing torch, which needs none of the gateway's set-up."""
        context = mp.get_context("spawn")
        conn, child_conn = context.Pipe()
        self._pipe = CorePipe(conn)
        self.run_dir = make_core_folder()
        JANITOR.watch(self.run_dir)  # removed even if this gateway is SIGKILLed
        # Not a daemon: the core must be able to start worker processes of its own.
        heartbeat = self._heartbeat = context.RawValue("Q", 0)
        self._step_record = new_record(context)
        self.process = context.Process(target=core_main,
                                       args=(child_conn, self.config, os.getpid(), self.run_dir,
                                             time.monotonic(),
                                             self.pool.paths() if self.pool else None,
                                             heartbeat, self._step_record),
                                       name="tokstream-engine-core")
        self.process.start()
        child_conn.close()
        return self

    async def start(self) -> "AsyncEngine":
        """Launch the core (unless launch() did) and return once it is ready; StartFailed's
        error (UserInputError or ReplicaError) if it is not."""
        if self.process is None:
            self.launch()
        self._loop = asyncio.get_running_loop()
        match await asyncio.to_thread(self._recv_first, self.config.start_timeout_s):
            case StartFailed(kind, text):
                self.process.join(5)
                self._remove_run_dir()
                raise (UserInputError if kind == ErrorKind.USER else ReplicaError)(text)
            case Ready() as ready:
                self.info = ready.info()
            case other:
                kill_tree(self.process)
                self._remove_run_dir()
                raise ProtocolError("gateway", other)
        self._record_ranks(self.info["worker_pids"])
        self._pipe.start_reader(self._loop, self._dispatch)
        self._pipe.start_sender()
        watch = HeartbeatWatch(self._heartbeat, silence_limit_s(self.config.step_timeout_s))
        self._watch = self._loop.create_task(self._watch_heartbeat(watch))
        return self

    async def _watch_heartbeat(self, watch: HeartbeatWatch) -> None:
        """A core whose heartbeat stops (stopped, frozen) is SIGKILLed and handled as dead:
        its pipe stays open, so nothing else would notice (engine/heartbeat.py)."""
        while self.dead is None and not self._closing:
            await asyncio.sleep(BEAT_INTERVAL_S)
            if watch.hung and self.dead is None and not self._closing:
                silent = watch.silent_s()
                log.error("engine core (pid %s) hung: no heartbeat for %.1f s; killing it",
                          self.pid, silent)
                self.process.kill()  # a stopped process dies of SIGKILL too
                self._died(f"engine core hung: no heartbeat for {silent:.1f} s (killed)")

    def in_flight(self) -> set[str] | None:
        """Once the core is dead: the requests of the step it died in (empty: between steps;
        None: it cannot be told, see engine/step_record.py)."""
        return in_flight(self._step_record) if self._step_record is not None else None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def num_live(self) -> int:
        return len(self._sinks)

    def _recv_first(self, timeout_s: float) -> CoreMessage:
        try:
            message = self._pipe.first(timeout_s)
        except EOFError:
            self.process.join(5)
            return StartFailed(ErrorKind.REPLICA, f"engine core exited while starting "
                                                  f"(exit code {self.process.exitcode})")
        if message is None:
            kill_tree(self.process)
            self._remove_run_dir()
            return StartFailed(ErrorKind.REPLICA, f"engine core hung while starting (not "
                                                  f"ready in {timeout_s:g} s): killed with "
                                                  f"its ranks")
        return message

    def _dispatch(self, message: CoreMessage) -> None:
        match message:
            case Deltas(deltas):
                self._deliver(deltas)
            case StateReply(token=token) | ScoreReply(token=token) | PoolAdopted(token=token):
                future = self._replies.pop(token, None)
                if future is not None and not future.done():
                    future.set_result(message)
            case StatusChanged():
                self._follow(message)
            case CoreDead(reason):
                self._died(reason)
            case _:
                raise ProtocolError("gateway", message)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            sink = self._sinks.get(delta.request_id)
            if sink is None:
                continue
            if delta.finished:
                del self._sinks[delta.request_id]
            try:
                sink(delta)
            except Exception:  # one request's failure must not cost the others a token
                log.exception("delta sink for %s failed", delta.request_id)

    def _follow(self, change: StatusChanged) -> None:
        self.replica_status = change.status
        self.restarts = change.restarts
        self.resumed_requests = change.resumed_requests
        self.info["worker_pids"] = change.worker_pids
        self._record_ranks(change.worker_pids)
        # Only a new recovery's time (a retry while down reports the previous one again).
        if change.recovery_s is not None and change.status == ReplicaStatus.READY \
                and change.recoveries > len(self.recovery_seconds):
            self.recovery_seconds.append(change.recovery_s)
        if self.on_status is not None:
            self.on_status(change.status, change.reason)

    def _died(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        sinks, self._sinks = self._sinks, {}
        if not self.keep_requests_on_death:
            for request_id, sink in sinks.items():
                sink(RequestDelta.failure(request_id, reason, ErrorKind.REPLICA))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(ReplicaError(f"engine is down: {reason}"))
        self._replies.clear()
        if self.on_dead is not None and not self._closing:
            self.on_dead(reason)

    def batch(self):
        """Whatever is sent inside reaches the core as one message, read before its next step:
        a new core's resumed requests then re-prefill together, where sent one by one the
        core could start stepping on the first while the others were still in the pipe."""
        return self._pipe.batch()

    def add_request(self, request: EngineRequest, sink: DeltaSink) -> None:
        """Submit request; sink receives every delta of it, the last with finish_reason set.
        Returns at once (the submission is queued for the sender thread)."""
        if self.dead is not None:
            raise ReplicaError(f"engine is down: {self.dead}")
        if request.request_id in self._sinks:
            raise UserInputError(f"duplicate request id {request.request_id!r}")
        self._sinks[request.request_id] = sink
        self._pipe.send(Add(request))

    def arm_spare(self) -> None:
        """Have the core keep a standby rank group from now on (a spare core taking over)."""
        if self.dead is None:
            self._pipe.send(ArmSpare())

    def abort(self, request_id: str) -> None:
        """Stop request_id; its final delta (finish_reason 'abort') still reaches its sink."""
        if self.dead is None:
            self._pipe.send(Abort(request_id))

    def forget(self, request_id: str) -> None:
        """Abort request_id and drop its sink: nothing more is delivered for it."""
        if self._sinks.pop(request_id, None) is not None:
            self.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Submit request and yield its deltas until the last one (finish_reason set)."""
        deltas: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.add_request(request, deltas.put_nowait)
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.forget(request.request_id)  # the caller stopped listening

    async def _ask(self, query: Callable[[int], StateQuery | ScoreQuery | AdoptPool]):
        """Send query(token) and wait for the reply with that token."""
        if self.dead is not None:
            raise ReplicaError(f"engine is down: {self.dead}")
        token = next(self._tokens)
        future = self._loop.create_future()
        self._replies[token] = future
        self._pipe.send(query(token))
        try:
            return await future
        finally:
            self._replies.pop(token, None)

    async def adopt_pool(self) -> PoolAdopted:
        """Have the core claim the pool files' block index and keep the cached blocks a dead
        core listed there (engine/recovery/pool_adoption.py). Only once no other process maps
        the files, and before the first request (server/replica/kept_pool.py)."""
        return await self._ask(AdoptPool)

    async def state(self) -> dict:
        """The core's snapshot (scheduler, block map, requests, events, pids); answered
        between steps, so it waits at most one step."""
        reply: StateReply = await self._ask(StateQuery)
        return reply.snapshot

    async def score(self, token_ids: list[int], start: int = 1) -> ScoreResult:
        """One teacher-forced pass over token_ids (see EngineCore.score)."""
        reply: ScoreReply = await self._ask(
            lambda token: ScoreQuery(token, list(token_ids), start))
        if reply.error_kind is not None:
            raise SCORE_ERRORS[reply.error_kind](reply.error)
        return reply.result

    def _record_ranks(self, pids: list[int]) -> None:
        ranks = []
        for pid in pids:
            try:
                ranks.append(psutil.Process(pid))
            except psutil.Error:
                pass
        self._ranks = ranks

    async def shutdown(self) -> None:
        """Stop the core (it stops its ranks); then kill any rank of it still there (a core
        that died could not) and remove its files."""
        self._closing = True
        self._pipe.send(Shutdown())
        await asyncio.to_thread(self.process.join, 15)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5)
        for rank in self._ranks:
            try:
                rank.kill()
            except psutil.Error:
                pass  # gone already (or its pid reused: psutil refuses)
        await asyncio.to_thread(wait_ended, self._ranks, 5)
        self._pipe.close()
        self._remove_run_dir()

    def discard(self) -> None:
        """End a core that was launched and is not (or no longer) served: its process tree if
        it still runs (its caller failed before start(), or gave up on a core still loading)
        and its folder."""
        if self.process is not None and self.process.is_alive():
            kill_tree(self.process)
        self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            JANITOR.forget(self.run_dir)


def kill_tree(process) -> None:
    """SIGKILL a child process and everything under it (a stopped one too), and reap it."""
    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        below = []
    process.kill()
    for child in below:
        try:
            child.kill()
        except psutil.Error:
            pass
    process.join(5)
    wait_ended(below, 5)
