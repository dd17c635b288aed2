"""Fairness between tenants: the virtual token counter (Sheng et al., OSDI'24).

Each tenant has a counter of service received: input tokens charged at admission (weight 1),
output tokens as they are produced (weight 2), both divided by the tenant's weight. The
backlogged tenant with the lowest counter is served next. A tenant that comes back from idle
is lifted to the lowest counter among the active tenants, so idleness earns no credit.
Pure Python, no torch.
"""

from __future__ import annotations

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class FairnessLedger:
    def __init__(self):
        self.counters: dict[str, float] = {}
        self.active: dict[str, int] = {}
        """Tenant -> requests it has waiting or running."""
        self.served_tokens: dict[str, int] = {}
        """Tenant -> input + output tokens served (for reporting shares)."""

    def on_arrival(self, tenant: str) -> None:
        if self.active.get(tenant, 0) == 0:
            others = [self.counters[t] for t, n in self.active.items() if n > 0 and t != tenant]
            floor = min(others) if others else 0.0
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.active[tenant] = self.active.get(tenant, 0) + 1

    def on_departure(self, tenant: str) -> None:
        self.active[tenant] -= 1

    def charge_input(self, tenant: str, num_tokens: int, weight: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + INPUT_WEIGHT * num_tokens / weight
        self.served_tokens[tenant] = self.served_tokens.get(tenant, 0) + num_tokens

    def charge_output(self, tenant: str, num_tokens: int, weight: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + OUTPUT_WEIGHT * num_tokens / weight
        self.served_tokens[tenant] = self.served_tokens.get(tenant, 0) + num_tokens

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def snapshot(self) -> list[dict]:
        return [{"tenant": t, "counter": round(self.counters.get(t, 0.0), 3),
                 "active_requests": self.active.get(t, 0),
                 "served_tokens": self.served_tokens.get(t, 0)}
                for t in sorted(set(self.counters) | set(self.active))]
