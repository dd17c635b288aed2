"""Admission: a bounded waiting queue, in requests and in prompt tokens.

"Waiting" is seen from the gateway: submitted and no output token yet (queued in the engine or
in prefill). Past either bound a new request is refused at once with an overload error and a
`retry-after` estimate, so the server never grows memory without bound; requests already
admitted are never harmed by the refusals.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokstream.errors import UserInputError
from tokstream.server.errors import ApiError


@dataclass
class AdmissionConfig:
    max_waiting_requests: int = 256
    """Most requests admitted but without a first token yet."""
    max_waiting_tokens: int = 262144
    """Most prompt tokens over those waiting requests."""

    def __post_init__(self):
        if self.max_waiting_requests < 1:
            raise UserInputError("max_waiting_requests must be >= 1")
        if self.max_waiting_tokens < 1:
            raise UserInputError("max_waiting_tokens must be >= 1")


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.waiting_requests = 0
        self.waiting_tokens = 0
        self.prefill_tokens_per_s = 0.0
        """Smoothed rate at which waiting prompt tokens leave the queue (retry-after)."""

    def check(self, num_prompt_tokens: int) -> None:
        """Raise an overload ApiError if admitting this prompt would pass a bound."""
        config = self.config
        if self.waiting_requests + 1 > config.max_waiting_requests:
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

    def enter(self, num_prompt_tokens: int) -> None:
        self.waiting_requests += 1
        self.waiting_tokens += num_prompt_tokens

    def leave(self, num_prompt_tokens: int, waited_s: float | None = None) -> None:
        """A waiting request got its first token (or ended, or was refused downstream)."""
        self.waiting_requests -= 1
        self.waiting_tokens -= num_prompt_tokens
        if waited_s and waited_s > 0:
            rate = num_prompt_tokens / waited_s
            self.prefill_tokens_per_s = (rate if self.prefill_tokens_per_s == 0
                                         else 0.8 * self.prefill_tokens_per_s + 0.2 * rate)

    def snapshot(self) -> dict:
        return {"waiting_requests": self.waiting_requests, "waiting_tokens": self.waiting_tokens,
                "max_waiting_requests": self.config.max_waiting_requests,
                "max_waiting_tokens": self.config.max_waiting_tokens}
