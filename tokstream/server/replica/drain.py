"""A shutdown that cuts no stream: uvicorn's server with a drain in front of its exit.

The first SIGTERM or SIGINT starts the drain: readiness turns 503 and new requests are refused
(503/529 with retry-after), while the open streams run to their end for up to
shutdown_timeout_s; whatever is still open then ends with an error event. Only then does
uvicorn stop, and the gateway stops the engine core and its ranks (which ignore the signal
themselves, so a SIGTERM to the whole process group drains the same way). A second signal
stops at once.

SIGUSR1 comes first on Kubernetes (the pod's preStop hook sends it): readiness turns 503 but
new requests are still served, so the endpoint picker, which drops a pod only when its
readiness fails, moves new work elsewhere before SIGTERM starts refusing it.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from tokstream.errors import ErrorKind

log = logging.getLogger("tokstream.server")

POLL_S = 0.05
FLUSH_TIMEOUT_S = 5.0
"""After the timeout, how long the error events get to reach their callers."""


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float):
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._loop.add_signal_handler(signal.SIGUSR1, self._leave)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread (an in-process test server): no signals to take
        await super().serve(sockets)

    def _leave(self) -> None:
        server = getattr(self.config.app.state, "server", None)
        if server is not None:
            leave(server)

    def handle_exit(self, sig, frame) -> None:
        if self._drain is not None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self._captured_signals.append(sig)
        # A signal handler may only hand work to the loop (it runs between two bytecodes).
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain = self._loop.create_task(self._run_drain())

    async def _run_drain(self) -> None:
        server = getattr(self.config.app.state, "server", None)
        if server is not None:
            await drain(server, self.shutdown_timeout_s)
        self.should_exit = True


def leave(server) -> None:
    """Leave the load balancers' pools: readiness 503, new requests still served."""
    if not server.leaving:
        server.leaving = True
        log.warning("leaving the pool: readiness is 503, requests are still served until "
                    "SIGTERM")
        server.events.record("leaving")


async def drain(server, timeout_s: float) -> None:
    """Refuse new work, wait for the open streams, end the rest with an error event."""
    registry = server.registry
    server.draining = True
    log.warning("shutting down: draining %d open streams (at most %g s)", len(registry),
                timeout_s)
    server.events.record("draining", open_streams=len(registry), timeout_s=timeout_s)
    if not await _until_empty(registry, timeout_s):
        failed = registry.fail_live(f"server shutting down: the stream did not end within "
                                    f"the shutdown timeout ({timeout_s:g} s)",
                                    ErrorKind.OVERLOADED)
        log.warning("shutdown timeout: %d streams ended with an error event", failed)
        await _until_empty(registry, FLUSH_TIMEOUT_S)
    server.supervisor.stop_restarting()


async def _until_empty(registry, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(registry):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True
