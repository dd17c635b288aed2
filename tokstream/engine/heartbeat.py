"""The engine core's heartbeat, and the gateway's watch on it.

A core process that is stopped (SIGSTOP) or frozen keeps its pipe open, so the gateway's
reader never sees it die: its streams receive nothing and /health stayed 200 (issue 31). So a
thread of the core bumps a counter in memory the two processes share, every BEAT_INTERVAL_S;
the gateway checks that it moves. A core whose counter has not moved for the watch's deadline
is hung: the gateway SIGKILLs it and handles it as any other core death (AsyncEngine._hung).

The gateway counts on its own clock only from the moment it last saw the counter move, so a
gateway that was itself busy for a while never mistakes that for a silent core. A main loop
blocked on its ranks is not this watch's to catch: the step deadline is.
"""

from __future__ import annotations

import threading
import time

BEAT_INTERVAL_S = 0.25
MAX_SILENCE_S = 10.0
"""The longest a core may be silent before it counts as hung, whatever --step-timeout is."""
MIN_SILENCE_S = 1.0
"""Never fewer than four beats, however small --step-timeout is."""


def silence_limit_s(step_timeout_s: float) -> float:
    """A core silent this long is hung: the step deadline (a rank silent that long counts as
    hung too), at most MAX_SILENCE_S."""
    return max(MIN_SILENCE_S, min(step_timeout_s, MAX_SILENCE_S))


def start_beating(counter) -> None:
    """In the core process: bump counter (a multiprocessing RawValue) every BEAT_INTERVAL_S
    from a daemon thread, for as long as the process runs."""
    def beat() -> None:
        while True:
            counter.value += 1
            time.sleep(BEAT_INTERVAL_S)

    threading.Thread(target=beat, name="tokstream-heartbeat", daemon=True).start()


class HeartbeatWatch:
    """The gateway's view of one core's counter."""

    def __init__(self, counter, limit_s: float, clock=time.monotonic):
        self.counter = counter
        self.limit_s = limit_s
        self.clock = clock
        self._last = counter.value
        self._moved_at = clock()

    def silent_s(self) -> float:
        """Seconds since the counter was last seen to move (0 when it has just moved)."""
        now, value = self.clock(), self.counter.value
        if value != self._last:
            self._last, self._moved_at = value, now
        return now - self._moved_at

    @property
    def hung(self) -> bool:
        return self.silent_s() > self.limit_s
