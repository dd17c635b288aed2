"""Who sends what next, inside the Locust process: closed-loop draws and timed arrivals.

Closed loop: each free user takes the next request of the main arrivals. Open loop: arrival
times are drawn ahead (Poisson or bursty gaps); a free user claims the next one and waits for
its time, so a request starts late only when every user is busy (the lateness is recorded).
Bursts of a class fire on their own timer in either mode and have users of their own, one
per burst request (up to 256), so a slow burst never delays the next.
Everything stops issuing at the duration or the request count, whichever comes first.
"""

from __future__ import annotations

import heapq
import itertools

from tokstream.loadgen.mix import Mix
from tokstream.loadgen.plan import (Limits, RequestSpec, arrival_gaps, burst_request,
                                    burst_times, main_request)


class Schedule:
    def __init__(self, mix: Mix, limits: Limits, seed: int, arrival: str, rate: float,
                 burstiness: float, duration_s: float, requests: int):
        self.mix, self.limits, self.seed = mix, limits, seed
        self.arrival, self.duration_s, self.requests = arrival, duration_s, requests
        self.issued = 0
        self._main = itertools.count()
        self._gaps = arrival_gaps(seed, arrival, rate, burstiness) if arrival != "closed" else None
        self._next_arrival = 0.0
        self._bursts: list[tuple[float, int, object]] = []
        order = itertools.count()
        for workload in mix.burst_classes:
            for burst, at in burst_times(workload, duration_s):
                for slot in range(workload.burst_size):
                    heapq.heappush(self._bursts, (at, next(order), (workload, burst, slot)))
                if len(self._bursts) > 100_000:
                    break

    @property
    def burst_requests(self) -> int:
        """Burst requests still to send (each gets a user, so a burst never waits for the
        previous one to finish)."""
        return len(self._bursts)

    def _open(self, elapsed_s: float) -> bool:
        if self.requests and self.issued >= self.requests:
            return False
        return not self.duration_s or elapsed_s < self.duration_s

    def _count(self, spec: RequestSpec) -> RequestSpec:
        spec.index = self.issued
        self.issued += 1
        return spec

    def next_closed(self, elapsed_s: float) -> RequestSpec | None:
        if not self._open(elapsed_s):
            return None
        return self._count(main_request(self.mix, self.limits, self.seed, next(self._main)))

    def next_timed_main(self) -> tuple[float, RequestSpec] | None:
        """The next open-loop arrival: (seconds from the start, request)."""
        self._next_arrival += next(self._gaps)
        if not self._open(self._next_arrival):
            return None
        spec = main_request(self.mix, self.limits, self.seed, next(self._main))
        return self._next_arrival, self._count(spec)

    def next_burst(self) -> tuple[float, RequestSpec] | None:
        if not self._bursts:
            return None
        at, _, (workload, burst, slot) = heapq.heappop(self._bursts)
        if not self._open(at):
            self._bursts.clear()
            return None
        spec = burst_request(self.mix, self.limits, self.seed, workload, burst, slot, 0)
        return at, self._count(spec)
