"""The gateway's end of the pipe to its engine core.

Two threads stand between the pipe and the event loop: a reader that hands each message to
the loop, and a sender that writes to the pipe, so the event loop never blocks on the core in
either direction (a pipe write blocks while the core is busy in a long step and the pipe
buffer is full).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from tokstream.engine.messages.gateway import (Batch, CoreDead, CoreMessage, GatewayMessage,
                                               Shutdown)


class CorePipe:
    def __init__(self, conn: Connection):
        self.conn = conn
        self._outbox: queue.SimpleQueue[GatewayMessage | None] = queue.SimpleQueue()
        self._held: list[GatewayMessage] | None = None
        """Messages held back to be sent as one Batch (inside batch())."""

    def first(self, timeout_s: float) -> CoreMessage | None:
        """The core's first message (Ready or StartFailed), read on the calling thread before
        the reader starts; None when none came within timeout_s, EOFError when the core
        exited."""
        return self.conn.recv() if self.conn.poll(timeout_s) else None

    def start_reader(self, loop: asyncio.AbstractEventLoop,
                     on_message: Callable[[CoreMessage], None]) -> None:
        """From now on on_message gets every message of the core on loop's thread, the last
        a CoreDead (the reader's own when the pipe closes)."""
        threading.Thread(target=self._read, args=(loop, on_message),
                         name="tokstream-engine-reader", daemon=True).start()

    def start_sender(self) -> None:
        threading.Thread(target=self._write, name="tokstream-engine-sender",
                         daemon=True).start()

    def _read(self, loop: asyncio.AbstractEventLoop,
              on_message: Callable[[CoreMessage], None]) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = CoreDead("engine core process exited")
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:
                return  # the loop is closed: nobody is listening any more
            if isinstance(message, CoreDead):
                return

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                return  # the reader reports the death
            if isinstance(message, Shutdown):
                return

    def send(self, message: GatewayMessage) -> None:
        """Queue message for the sender thread (or hold it, inside batch())."""
        if self._held is not None:
            self._held.append(message)
        else:
            self._outbox.put(message)

    @contextlib.contextmanager
    def batch(self):
        """Whatever is sent inside reaches the core as one Batch."""
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._outbox.put(Batch(held))

    def close(self) -> None:
        """Stop the sender and close the pipe."""
        self._outbox.put(None)
        self.conn.close()
