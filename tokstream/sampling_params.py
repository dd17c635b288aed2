"""How one request's tokens are chosen and when it stops. Validated on construction; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.errors import UserInputError


@dataclass
class SamplingParams:
    """Per-request generation settings (what the API bodies and CLI flags map to)."""

    max_tokens: int = 256
    """Most output tokens to generate."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 means no limit."""
    seed: int | None = None
    """Randomness is a pure function of (seed, output position); None gets one at admission."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the text; never streamed, not even partially."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (in addition to the model's end-of-sequence ids)."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence tokens (benchmarks)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise UserInputError("max_tokens must be an integer")
        if self.max_tokens < 1:
            raise UserInputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also catches NaN
            raise UserInputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserInputError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UserInputError("seed must be in [0, 2**63)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserInputError("stop sequences must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
