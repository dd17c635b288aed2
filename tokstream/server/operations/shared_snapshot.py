"""One engine-core snapshot shared by every reader (/metrics, /v1/state, `tokstream top`).

The core answers a snapshot between steps, so each one asked for costs the batch a pause. Here
concurrent readers share one request in flight, a snapshot is reused while it is fresh (young,
and no request has started or ended since), and a reader never waits longer than `patience_s`
for a refresh held up by a slow step: it gets the previous snapshot instead. A reader that must
answer fast whatever the core does (/metrics: the endpoint picker polls it every 50 ms and
gives up after 1 s) passes a short patience of its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from tokstream.errors import ReplicaError

MAX_AGE_S = 0.1
"""A snapshot this young is served as is: a hundred scrapers a second cost ten core queries."""
PATIENCE_S = 1.0
"""Longest a reader holding an older snapshot waits for a new one."""
TIMEOUT_S = 5.0
"""Longest one core query may take (and a reader with no snapshot at all waits)."""


class SharedSnapshot:
    def __init__(self, fetch: Callable[[], Awaitable[dict]], max_age_s: float = MAX_AGE_S,
                 patience_s: float = PATIENCE_S, timeout_s: float = TIMEOUT_S):
        self.fetch = fetch
        self.max_age_s = max_age_s
        self.patience_s = patience_s
        self.timeout_s = timeout_s
        self.value: dict | None = None
        """The latest snapshot (None until the first one arrives)."""
        self._fetched_at = float("-inf")
        self._refresh: asyncio.Future | None = None
        self._changes = 0

    def invalidate(self) -> None:
        """Something the snapshot shows has changed (a request started or ended)."""
        self._changes += 1
        self._fetched_at = float("-inf")

    @property
    def fresh(self) -> bool:
        return self.value is not None and time.monotonic() - self._fetched_at < self.max_age_s

    async def get(self, patience_s: float | None = None) -> dict | None:
        """The latest snapshot, refreshed if it is not fresh; patience_s: the longest this
        reader waits, with or without a snapshot (default: patience_s, or timeout_s while
        there is none). A refresh still running then lands for later readers."""
        loop = asyncio.get_running_loop()
        if patience_s is None:
            patience_s = self.timeout_s if self.value is None else self.patience_s
        deadline = loop.time() + patience_s
        # A refresh asked before the latest change comes back stale: then another is asked,
        # until the deadline.
        while not self.fresh:
            if self._refresh is None:
                self._refresh = asyncio.ensure_future(self._run())
            refresh = self._refresh
            if loop.time() >= deadline:
                break
            # asyncio.wait never cancels what it waits for: it lands for later readers.
            await asyncio.wait({refresh}, timeout=deadline - loop.time())
            if refresh.done() and not refresh.result():
                break  # the core is slow or gone: keep the last snapshot
        return self.value

    async def _run(self) -> bool:
        """Ask the core once; False if it did not answer."""
        asked_at, changes = time.monotonic(), self._changes
        try:
            self.value = await asyncio.wait_for(self.fetch(), self.timeout_s)
            if changes == self._changes:  # else it may predate the change: stale at once
                self._fetched_at = asked_at
            return True
        except (asyncio.TimeoutError, ReplicaError):
            return False
        finally:
            self._refresh = None
