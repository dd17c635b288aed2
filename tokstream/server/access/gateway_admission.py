"""Admission: a bounded waiting queue, in requests and in prompt tokens.

"Waiting" is seen from the gateway: submitted and no output token yet (queued in the engine or
in prefill). Past either bound a new request is refused at once with an overload error and a
`retry-after` estimate, so the server never grows memory without bound; requests already
admitted are never harmed by the refusals.

With tenants, each one owns a share of both bounds in proportion to its weight: a tenant past
its share gets 429 (its own limit), so one tenant's flood never fills the queue for the others.
"""

from __future__ import annotations

from collections import Counter

from tokstream.gateway_config import AdmissionConfig
from tokstream.server.api_errors import ApiError


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.waiting_requests = 0
        self.waiting_tokens = 0
        self.prefill_tokens_per_s = 0.0
        """Smoothed rate at which waiting prompt tokens leave the queue (retry-after)."""
        self.weights: dict[str, float] = {}
        """Tenant name -> weight; empty: no per-tenant shares (open mode)."""
        self.tenant_requests: Counter[str] = Counter()
        self.tenant_tokens: Counter[str] = Counter()

    def set_weights(self, weights: dict[str, float]) -> None:
        self.weights = dict(weights)

    def share(self, tenant: str) -> tuple[int, int]:
        """(waiting requests, waiting prompt tokens) the tenant may hold at most."""
        fraction = self.weights[tenant] / sum(self.weights.values())
        return (max(1, int(self.config.max_waiting_requests * fraction)),
                max(1, int(self.config.max_waiting_tokens * fraction)))

    def check(self, num_prompt_tokens: int, tenant: str | None = None,
              num_requests: int = 1) -> None:
        """Raise a 429 if this tenant would pass its share of the queue, an overload ApiError
        if admitting these prompts (num_requests of them, num_prompt_tokens in all) would
        pass a bound. Into an empty queue (the tenant's share of it) any one request goes,
        however large, so that none is refused forever."""
        config = self.config
        if tenant is not None and tenant in self.weights:
            max_requests, max_tokens = self.share(tenant)
            requests, tokens = self.tenant_requests[tenant], self.tenant_tokens[tenant]
            if requests > 0 and (requests + num_requests > max_requests
                                 or tokens + num_prompt_tokens > max_tokens):
                raise ApiError("rate_limit_error",
                               f"tenant {tenant!r} has {requests} requests ({tokens} prompt "
                               f"tokens) waiting, its share of the queue ({max_requests} "
                               f"requests, {max_tokens} tokens); retry later",
                               retry_after=self.retry_after())
        if self.waiting_requests > 0 \
                and self.waiting_requests + num_requests > config.max_waiting_requests:
            reason = (f"{self.waiting_requests} requests already waiting (limit "
                      f"{config.max_waiting_requests})")
        elif self.waiting_tokens + num_prompt_tokens > config.max_waiting_tokens \
                and self.waiting_requests > 0:
            reason = (f"{self.waiting_tokens} prompt tokens already waiting; this request's "
                      f"{num_prompt_tokens} would pass the limit of {config.max_waiting_tokens}")
        else:
            return
        raise ApiError("overloaded_error", f"server overloaded: {reason}; retry later",
                       retry_after=self.retry_after())

    def retry_after(self) -> float:
        if self.prefill_tokens_per_s > 0:
            return min(60.0, max(1.0, self.waiting_tokens / self.prefill_tokens_per_s))
        return 1.0

    def enter(self, num_prompt_tokens: int, tenant: str | None = None) -> None:
        self.waiting_requests += 1
        self.waiting_tokens += num_prompt_tokens
        if tenant is not None:
            self.tenant_requests[tenant] += 1
            self.tenant_tokens[tenant] += num_prompt_tokens

    def leave(self, num_prompt_tokens: int, waited_s: float | None = None,
              tenant: str | None = None) -> None:
        """A waiting request got its first token (or ended, or was refused downstream)."""
        self.waiting_requests -= 1
        self.waiting_tokens -= num_prompt_tokens
        if tenant is not None:
            self.tenant_requests[tenant] -= 1
            self.tenant_tokens[tenant] -= num_prompt_tokens
        if waited_s and waited_s > 0:
            rate = num_prompt_tokens / waited_s
            self.prefill_tokens_per_s = (rate if self.prefill_tokens_per_s == 0
                                         else 0.8 * self.prefill_tokens_per_s + 0.2 * rate)

    def snapshot(self) -> dict:
        return {"waiting_requests": self.waiting_requests, "waiting_tokens": self.waiting_tokens,
                "max_waiting_requests": self.config.max_waiting_requests,
                "max_waiting_tokens": self.config.max_waiting_tokens}
