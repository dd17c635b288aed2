"""Token sampling. Randomness is a pure function of (request seed, output position), so a
request that is preempted, or resumed on a restarted replica, continues exactly as if it had
never been interrupted, whatever else shares its batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """Mix (seed, position) into one 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplingRow:
    temperature: float
    top_p: float
    top_k: int
    seed: int
    position: int
    """Output index of the token being sampled."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits (S, vocab) float32 -> one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        if not row.greedy:
            tokens[i] = _sample_row(logits[i], row)
    return tokens


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    scaled = logits / row.temperature  # (vocab,)
    if row.top_k > 0 and row.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, row.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if row.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= row.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    # Gumbel-max: argmax(logits + Gumbel noise) is a sample from softmax(logits).
    generator = torch.Generator().manual_seed(position_seed(row.seed, row.position))
    uniform = torch.rand(scaled.shape[0], generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
    return int((scaled.double() + gumbel).argmax())
