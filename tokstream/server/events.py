"""Recent gateway events (refusals, cancels, failures, replica status changes) for /v1/state,
kept beside the engine core's own (preemptions, rank deaths, restarts)."""

from __future__ import annotations

import time
from collections import deque

MAX_EVENTS = 128


class EventLog:
    def __init__(self, size: int = MAX_EVENTS):
        self.size = size
        self.recent: deque[dict] = deque(maxlen=size)

    def record(self, kind: str, request_id: str | None = None, **fields) -> None:
        self.recent.append({"time": time.time(), "kind": kind, "request_id": request_id,
                            **fields})

    def merged(self, engine_events: list[dict]) -> list[dict]:
        """The gateway's and the engine's events (marked source "engine") in time order, the
        last `size` of them."""
        events = list(self.recent) + [{**e, "source": "engine"} for e in engine_events]
        return sorted(events, key=lambda e: e["time"])[-self.size:]
