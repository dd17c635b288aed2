"""The async engine API the server uses: submit a request, receive its deltas, abort it, ask
the core for a state snapshot or a score pass.

The engine core runs in a child process. Two threads stand between it and the event loop: a
reader that hands each message to the loop, and a sender that writes to the pipe, so the event
loop never blocks on the engine in either direction (a pipe write blocks while the core is busy
in a long step and the pipe buffer is full).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable

import psutil

from tokstream.config import EngineConfig
from tokstream.engine.core_process import core_main
from tokstream.engine.messages import EngineRequest, RequestDelta, ScoreResult
from tokstream.errors import ErrorKind, OverloadedError, ReplicaError, UserInputError

log = logging.getLogger("tokstream.engine")

DeltaSink = Callable[[RequestDelta], None]
"""Called on the event loop thread with each delta of one request, in order."""


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.info: dict = {}
        self.dead: str | None = None
        self._sinks: dict[str, DeltaSink] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: list | None = None
        """Messages held back to be sent as one (inside batch())."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.replica_status = "ready"
        """ready | recovering | down, as the core last reported (see EngineCore.recover)."""
        self.restarts = 0
        """Rank-group restarts this core has done."""
        self.resumed_requests = 0
        """Requests this core put back in line after its rank-group restarts."""
        self.recovery_seconds: list[float] = []
        self.keep_requests_on_death = False
        """Set by an owner that resumes the live requests on a new engine after a death (the
        gateway's supervisor): the sinks then get no error delta, and are simply dropped."""
        self.on_status: Callable[[str, str | None], None] | None = None
        """Called on the event loop thread with (status, reason) when the replica's status
        changes."""
        self.on_dead: Callable[[str], None] | None = None
        """Called on the event loop thread once, when the core process is found dead."""
        self.run_dir: str | None = None
        """The core's folder for its rank groups' files; removed at shutdown."""
        self._ranks: list[psutil.Process] = []
        """The core's ranks as last reported (psutil checks identity before a kill)."""

    async def start(self) -> "AsyncEngine":
        self._loop = asyncio.get_running_loop()
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.run_dir = tempfile.mkdtemp(prefix="tokstream-core-")
        # Not a daemon: the core must be able to start worker processes of its own.
        self.process = context.Process(target=core_main,
                                       args=(child_conn, self.config, os.getpid(), self.run_dir,
                                             time.monotonic()),
                                       name="tokstream-engine-core")
        self.process.start()
        child_conn.close()
        message = await asyncio.to_thread(self._recv_first, self.config.start_timeout_s)
        if message[0] == "failed":
            _, user_error, text = message
            self.process.join(5)
            self._remove_run_dir()
            raise (UserInputError if user_error else ReplicaError)(text)
        self.info = message[1]
        self._record_ranks(self.info["worker_pids"])
        threading.Thread(target=self._read, name="tokstream-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="tokstream-engine-sender", daemon=True).start()
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def num_live(self) -> int:
        return len(self._sinks)

    def _recv_first(self, timeout_s: float):
        try:
            if not self._conn.poll(timeout_s):
                kill_tree(self.process)
                self._remove_run_dir()
                return ("failed", False, f"engine core hung while starting (not ready in "
                                         f"{timeout_s:g} s): killed with its ranks")
            return self._conn.recv()
        except EOFError:
            self.process.join(5)
            return ("failed", False, f"engine core exited while starting "
                                     f"(exit code {self.process.exitcode})")

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                message = ("dead", "engine core process exited")
            try:
                self._loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:
                return  # the loop is closed: nobody is listening any more
            if message[0] == "dead":
                return

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the reader reports the death
            if message[0] == "shutdown":
                return

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "deltas":
            for delta in message[1]:
                sink = self._sinks.get(delta.request_id)
                if sink is None:
                    continue
                if delta.finished:
                    del self._sinks[delta.request_id]
                try:
                    sink(delta)
                except Exception:  # one request's failure must not cost the others a token
                    log.exception("delta sink for %s failed", delta.request_id)
        elif kind in ("state", "score"):
            future = self._replies.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2:])
        elif kind == "status":
            _, status, reason, info = message
            self.replica_status = status
            self.restarts = info["restarts"]
            self.resumed_requests = info.get("resumed_requests", self.resumed_requests)
            self.info["worker_pids"] = info["worker_pids"]
            self._record_ranks(info["worker_pids"])
            # Only a new recovery's time (a retry while down reports the previous one again).
            if info.get("recovery_s") is not None and status == "ready" \
                    and info.get("recoveries", 1) > len(self.recovery_seconds):
                self.recovery_seconds.append(info["recovery_s"])
            if self.on_status is not None:
                self.on_status(status, reason)
        elif kind == "dead":
            if self.dead is not None:
                return
            self.dead = message[1]
            sinks, self._sinks = self._sinks, {}
            if not self.keep_requests_on_death:
                for request_id, sink in sinks.items():
                    sink(RequestDelta(request_id, [], 0, "", finish_reason="error",
                                      error=self.dead, error_kind=ErrorKind.REPLICA))
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(ReplicaError(f"engine is down: {self.dead}"))
            self._replies.clear()
            if self.on_dead is not None and not self._closing:
                self.on_dead(self.dead)

    def _send(self, message) -> None:
        if self._batch is not None:
            self._batch.append(message)
        else:
            self._outbox.put(message)

    @contextlib.contextmanager
    def batch(self):
        """Whatever is sent inside reaches the core as one message, read before its next step:
        a new core's resumed requests then re-prefill together, where sent one by one the
        core could start stepping on the first while the others were still in the pipe."""
        self._batch = []
        try:
            yield
        finally:
            held, self._batch = self._batch, None
            if held:
                self._outbox.put(("batch", held))

    def add_request(self, request: EngineRequest, sink: DeltaSink) -> None:
        """Submit request; sink receives every delta of it, the last with finish_reason set.
        Returns at once (the submission is queued for the sender thread)."""
        if self.dead is not None:
            raise ReplicaError(f"engine is down: {self.dead}")
        if request.request_id in self._sinks:
            raise UserInputError(f"duplicate request id {request.request_id!r}")
        self._sinks[request.request_id] = sink
        self._send(("add", request))

    def arm_spare(self) -> None:
        """Have the core keep a standby rank group from now on (a spare core taking over)."""
        if self.dead is None:
            self._send(("arm_spare",))

    def abort(self, request_id: str) -> None:
        """Stop request_id; its final delta (finish_reason 'abort') still reaches its sink."""
        if self.dead is None:
            self._send(("abort", request_id))

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

    async def _ask(self, *message):
        if self.dead is not None:
            raise ReplicaError(f"engine is down: {self.dead}")
        token = next(self._tokens)
        future = self._loop.create_future()
        self._replies[token] = future
        self._send((message[0], token, *message[1:]))
        try:
            return await future
        finally:
            self._replies.pop(token, None)

    async def state(self) -> dict:
        """The core's snapshot (scheduler, block map, requests, events, pids); answered
        between steps, so it waits at most one step."""
        (snapshot,) = await self._ask("state")
        return snapshot

    async def score(self, token_ids: list[int], start: int = 1) -> ScoreResult:
        """One teacher-forced pass over token_ids (see EngineCore.score)."""
        result, error_kind, text = await self._ask("score", list(token_ids), start)
        if error_kind == "user":
            raise UserInputError(text)
        if error_kind == "overloaded":
            raise OverloadedError(text)
        if error_kind is not None:
            raise ReplicaError(text)
        return result

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
        self._send(("shutdown",))
        await asyncio.to_thread(self.process.join, 15)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5)
        for rank in self._ranks:
            try:
                rank.kill()
            except psutil.Error:
                pass  # gone already (or its pid reused: psutil refuses)
        await asyncio.to_thread(psutil.wait_procs, self._ranks, 5)
        self._outbox.put(None)
        self._conn.close()
        self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


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
    psutil.wait_procs(below, 5)
