"""Fairness between tenants, measured against what each one asked for.

Raw throughput per tenant says little under a hot tenant: a tenant that sends 10x the requests
should get more tokens than the others, and Jain's index over raw tokens/s then reads low
(0.41 for 10:1:1:1) even when the scheduler was perfectly fair. The figure that answers "was
the server fair?" compares each tenant's throughput with its max-min fair share of the
throughput the server achieved, while the load was offered: over the window from the first
request sent to the last one (after it, the drain serves whatever is left, and a backlog that
drains fully would make any order of service look fair):

- demand: the tokens a tenant offered in the window (prompt + max_tokens of every request it
  sent), per second of the window;
- achieved: the tokens it was served by the window's end: a request's prompt once its first
  token arrived, and each output token as it arrived, per second of the window;
- fair share: water-filling the tenants' total achieved throughput over their demands. A
  tenant that asks less than an equal (or weighted) share gets all it asked; what it leaves is
  split among the others, again up to each one's demand, until the throughput is spent.

Jain's index over achieved / fair share is 1 when every tenant got its fair share, whatever
their demands; `min_fair_share_ratio` is the worst-served tenant's fraction of its share. In
a closed loop demand follows service (a user sends again when answered), so the figure speaks
mostly for open-loop runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tokstream.stats import jain_index


@dataclass
class TenantShare:
    """One tenant's demand, max-min fair share and achieved throughput (tokens/s of the load
    window)."""

    demand_tokens_per_s: float
    """What it offered: prompt + max_tokens of every request it sent."""
    fair_share_tokens_per_s: float
    """Its water-filled share of the tenants' achieved throughput (never above its demand)."""
    achieved_tokens_per_s: float
    """Prompt and output tokens served to its requests by the window's end."""
    weight: float = 1.0
    """Its weight in the water-filling (the mix's [tenant_weights]; 1 when not given)."""

    @property
    def ratio(self) -> float | None:
        """Achieved / fair share (1: it got exactly its share); None with no share to get."""
        if self.fair_share_tokens_per_s <= 0:
            return None
        return self.achieved_tokens_per_s / self.fair_share_tokens_per_s

    def row(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def water_fill(demands: dict[str, float], capacity: float,
               weights: dict[str, float] | None = None) -> dict[str, float]:
    """Weighted max-min fair allocation of `capacity` over `demands`.

    Every round offers each unsatisfied tenant `weight x level`, where level splits what is
    left by the unsatisfied tenants' total weight; those whose demand fits get their demand
    and leave, and the rest split the remainder in the next round. When no demand fits, each
    remaining tenant gets weight x level. The allocations sum to min(capacity, total demand),
    none exceeds its demand, and no tenant can gain without taking from one that has less
    (relative to its weight)."""
    for tenant, demand in demands.items():
        if demand < 0:
            raise ValueError(f"tenant {tenant}: demand {demand} is negative")
    weights = weights or {}
    if any(weights.get(t, 1.0) <= 0 for t in demands):
        raise ValueError("tenant weights must be > 0")
    share = {t: 0.0 for t in demands}
    left = max(0.0, capacity)
    waiting = {t for t, d in demands.items() if d > 0}
    while waiting and left > 0:
        level = left / sum(weights.get(t, 1.0) for t in waiting)
        satisfied = {t for t in waiting if demands[t] <= weights.get(t, 1.0) * level}
        if not satisfied:
            for tenant in waiting:
                share[tenant] = weights.get(tenant, 1.0) * level
            break
        for tenant in satisfied:
            share[tenant] = demands[tenant]
            left -= demands[tenant]
        waiting -= satisfied
    return share


def load_window(samples: list[dict]) -> tuple[float, float]:
    """(start, end) in run seconds of the time load was offered: first send to last send; a
    run that sent everything at once falls back to first send to last end."""
    start = min(s["start_s"] for s in samples)
    end = max(s["start_s"] for s in samples)
    if end <= start:
        end = max(s["start_s"] + s["e2e_s"] for s in samples)
    return start, end


def served_by(sample: dict, end_s: float) -> int:
    """Tokens served to one request by run time end_s: its prompt once its first token came,
    and every output token that came by then."""
    times = [sample["start_s"] + t for t in sample["event_times_s"]]
    if not times or times[0] > end_s:
        return 0
    return sample["prompt_tokens"] + sum(n for t, n in zip(times, sample["event_tokens"])
                                         if t <= end_s)


def tenant_shares(samples: list[dict], weights: dict[str, float] | None = None
                  ) -> dict[str, TenantShare]:
    """Demand, fair share and achieved throughput in the load window of every tenant that
    sent a request."""
    if not samples:
        return {}
    start, end = load_window(samples)
    if end <= start:
        return {}
    offered: dict[str, float] = {}
    served: dict[str, float] = {}
    for sample in samples:
        tenant = sample["tenant"]
        asked = sample["prompt_tokens"] + sample["max_tokens"]
        offered[tenant] = offered.get(tenant, 0.0) + asked
        served[tenant] = served.get(tenant, 0.0) + served_by(sample, end)
    span = end - start
    demands = {t: tokens / span for t, tokens in offered.items()}
    achieved = {t: tokens / span for t, tokens in served.items()}
    fair = water_fill(demands, sum(achieved.values()), weights)
    return {t: TenantShare(demands[t], fair[t], achieved[t], (weights or {}).get(t, 1.0))
            for t in sorted(offered)}


def fairness(samples: list[dict], per_tenant: dict[str, dict],
             weights: dict[str, float] | None = None) -> dict:
    """The report's fairness block: Jain's index against fair share (the headline), the raw
    tokens/s index and the TTFT index, over the tenants that sent requests (one that asked
    nothing is owed nothing)."""
    active = {t: b for t, b in per_tenant.items() if b["requests"]}
    shares = tenant_shares(samples, weights)
    ratios = [s.ratio for s in shares.values() if s.ratio is not None]
    raw = [b["total_tokens_per_s"] or 0.0 for b in active.values()]
    speeds = [1.0 / b["ttft_s"]["p50"] for b in active.values() if b["ttft_s"]["p50"]]
    several = len(active) > 1
    return {
        "tenants": len(active),
        "jain_index_fair_share": jain_index(ratios) if several and len(ratios) > 1 else None,
        "min_fair_share_ratio": min(ratios) if several and ratios else None,
        "fair_share_basis": "achieved / max-min fair share of the achieved tokens/s, given each "
                            "tenant's demand (prompt + max_tokens of the requests it sent), "
                            "from the first request sent to the last",
        "window_s": list(load_window(samples)) if samples else None,
        "per_tenant": {t: s.row() for t, s in shares.items()},
        "jain_index_raw_tokens": jain_index(raw) if several else None,
        "raw_tokens_basis": "input + output tokens/s of each tenant's completed requests over "
                            "the whole run, whatever it asked "
                            "(low under a hot tenant even when the server was fair)",
        "jain_index_ttft": jain_index(speeds) if len(speeds) > 1 else None,
        "ttft_basis": "1 / p50 TTFT of each tenant (even waiting, whatever each one asks)",
    }
