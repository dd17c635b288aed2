"""The waiting queue and the order new work is admitted in. Pure Python, no torch.

Order: requests preempted mid-generation first (they already hold the caller's attention),
then by priority tier (lower number first), then — under the "fair" policy — the tenant with
the lowest virtual token counter, then arrival. "fcfs" ignores tenants (for comparison).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from tokstream.engine.request import Request
from tokstream.engine.scheduler.fairness import FairnessLedger

POLICIES = ("fair", "fcfs")


class WaitingQueue:
    def __init__(self, policy: str, ledger: FairnessLedger):
        self.policy = policy
        self.ledger = ledger
        self._preempted: deque[Request] = deque()
        self._by_tenant: dict[str, list[tuple]] = {}
        """Tenant -> heap of (priority, arrival, seq, request)."""
        self._removed: set[int] = set()
        """id() of requests removed from inside a heap, dropped lazily when they surface."""
        self._count = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self):
        yield from self._preempted
        for heap in self._by_tenant.values():
            for *_, request in sorted(heap, key=lambda e: e[:3]):
                if id(request) not in self._removed:
                    yield request

    def add(self, request: Request) -> None:
        heap = self._by_tenant.setdefault(request.tenant, [])
        heapq.heappush(heap, (request.priority, request.arrival, next(self._seq), request))
        self._count += 1

    def push_front(self, request: Request) -> None:
        """A preempted request: first in line again."""
        self._preempted.appendleft(request)
        self._count += 1

    def add_interrupted(self, request: Request) -> None:
        """A request that was generating when a failure cut it off (resumed on a new engine
        core): in line with the preempted ones, behind them, in the order these come."""
        self._preempted.append(request)
        self._count += 1

    def peek(self, eligible=None) -> Request | None:
        """The request to admit next; tenants whose next request fails eligible() wait."""
        if self._preempted:
            return self._preempted[0]
        best, best_key = None, None
        for tenant, heap in self._by_tenant.items():
            self._drop_removed(heap)
            if not heap:
                continue
            entry = heap[0]
            if eligible is not None and not eligible(entry[3]):
                # Look past a request that must wait (rare: only capped long requests).
                entry = next((e for e in sorted(heap, key=lambda e: e[:3])
                              if id(e[3]) not in self._removed and eligible(e[3])), None)
                if entry is None:
                    continue
            priority, arrival, seq, request = entry
            fairness = self.ledger.counter(tenant) if self.policy == "fair" else 0.0
            key = (priority, fairness, arrival, seq)
            if best_key is None or key < best_key:
                best, best_key = request, key
        return best

    def remove(self, request: Request) -> None:
        if request in self._preempted:
            self._preempted.remove(request)
        else:
            self._removed.add(id(request))
        self._count -= 1

    def _drop_removed(self, heap: list) -> None:
        while heap and id(heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(heap)[3]))
