"""The async engine API the server uses: submit a request, iterate its deltas, abort it.

The engine core runs in a child process; a reader thread turns its messages into per-request
asyncio queues, so the event loop never blocks on the engine.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from collections.abc import AsyncIterator

from tokstream.config import EngineConfig
from tokstream.engine.core_process import core_main
from tokstream.engine.messages import EngineRequest, RequestDelta
from tokstream.errors import ReplicaError, UserInputError


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.info: dict = {}
        self.dead: str | None = None
        self._streams: dict[str, asyncio.Queue[RequestDelta]] = {}
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> "AsyncEngine":
        self._loop = asyncio.get_running_loop()
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not a daemon: the core must be able to start worker processes of its own.
        self.process = context.Process(target=core_main, args=(child_conn, self.config),
                                       name="tokstream-engine-core")
        self.process.start()
        child_conn.close()
        message = await asyncio.to_thread(self._recv_first)
        if message[0] == "failed":
            _, user_error, text = message
            raise (UserInputError if user_error else ReplicaError)(text)
        self.info = message[1]
        threading.Thread(target=self._read, name="tokstream-engine-reader", daemon=True).start()
        return self

    def _recv_first(self):
        try:
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
            self._loop.call_soon_threadsafe(self._dispatch, message)
            if message[0] == "dead":
                return

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "deltas":
            for delta in message[1]:
                queue = self._streams.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
        elif kind == "dead":
            self.dead = message[1]
            for request_id, queue in self._streams.items():
                queue.put_nowait(RequestDelta(request_id, [], 0, "", finish_reason="error",
                                              error=self.dead))

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Submit request and yield its deltas until the last one (finish_reason set)."""
        if self.dead is not None:
            raise ReplicaError(f"engine is down: {self.dead}")
        if request.request_id in self._streams:
            raise UserInputError(f"duplicate request id {request.request_id!r}")
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._streams[request.request_id] = queue
        finished = False
        try:
            self._send(("add", request))
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                yield delta
        finally:
            del self._streams[request.request_id]
            if not finished and self.dead is None:
                self.abort(request.request_id)  # the caller stopped listening

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except OSError:
            pass

    async def shutdown(self) -> None:
        try:
            self._send(("shutdown",))
        except OSError:
            pass
        await asyncio.to_thread(self.process.join, 15)
        if self.process.is_alive():
            self.process.kill()
        self._conn.close()
