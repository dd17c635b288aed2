"""Connection-level limits uvicorn does not set on its own: a deadline for each request head
(slowloris: uvicorn starts no timer before a head is complete), a cap on open connections
answered with a clear 503, and file descriptors kept in reserve for the engine (a core restart
must still be able to open its pipes when clients hold everything else).
"""

from __future__ import annotations

import json
import logging
import resource
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tokstream.server")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    """Open client connections at most (past it: 503 and close)."""
    header_timeout_s: float
    """From a connection's first byte, or its previous response, to a complete request head."""


def connection_cap(configured: int, reserve: int, descriptor_limit: int) -> int:
    """The connection cap: what was configured (0: no preference), never more than the
    descriptor limit less the reserve."""
    available = max(1, descriptor_limit - reserve)
    return min(configured, available) if configured else available


def raise_descriptor_limit() -> int:
    """Lift this process's soft descriptor limit to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def _refusal(limit: int) -> bytes:
    body = json.dumps({"type": "error", "error": {
        "type": "overloaded_error",
        "message": f"too many open connections (limit {limit}); retry later"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode() + body)


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the limits above (pass as uvicorn.Config(http=...))."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning("refused a connection: %d open (limit %d)", len(self.connections),
                            limits.max_connections)
                transport.write(_refusal(limits.max_connections))
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of a new request head
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a complete head started a new request
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if (self.cycle is None or self.cycle.response_complete) \
                    and not self.transport.is_closing():
                log.info("closed a connection that sent no complete request head in %g s",
                         limits.header_timeout_s)
                self.transport.close()

    return GuardedH11Protocol
