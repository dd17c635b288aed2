"""Recent gateway events (refusals, cancels, failures, replica status changes) for /v1/state,
kept beside the engine core's own (preemptions, rank deaths, restarts)."""

from __future__ import annotations

import time
from collections import deque

from tokstream.core_state import Event

MAX_EVENTS = 128


class EventLog:
    def __init__(self, size: int = MAX_EVENTS):
        self.size = size
        self.recent: deque[Event] = deque(maxlen=size)

    def record(self, kind: str, request_id: str | None = None, **fields) -> None:
        self.recent.append(Event(time.time(), kind, request_id, fields))

    def merged(self, engine_events: list[Event]) -> list[Event]:
        """The gateway's and the engine's events in time order, the last `size` of them."""
        return sorted(list(self.recent) + engine_events, key=lambda e: e.time)[-self.size:]
