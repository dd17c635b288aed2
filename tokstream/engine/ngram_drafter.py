"""Prompt-lookup drafting (issue 34): guess a request's next tokens from its own history.

Answers repeat spans of their prompt or of themselves (quoting, editing code, summarising,
tool arguments, JSON keys). The drafter looks for the longest suffix of the request's tokens
(prompt + output, `max_n` tokens down to `min_n`) that occurred earlier, and proposes the up to
k tokens that followed its most recent earlier occurrence (a continuation that runs into the
present repeats with the match's period). A rank then checks them all in one forward pass; a
wrong guess costs only the verification.

Pure Python, no torch: one drafter per request, fed each token as it is accepted. Every
appended token indexes the n-grams that end just before it, so the n-grams ending at the
newest token (the suffix being looked up) are never matched against themselves; appending
and drafting cost O(max_n) dictionary operations, whatever the history's length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramConfig:
    """How drafts are looked up."""

    max_n: int = 4
    """Longest suffix tried first (longer matches predict better)."""
    min_n: int = 2
    """Shortest suffix accepted (a 1-token match is mostly chance)."""

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(f"min_n must be at least 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"max_n ({self.max_n}) must be at least min_n ({self.min_n})")


class NgramDrafter:
    """One request's token history and the index of its n-grams."""

    def __init__(self, tokens: Iterable[int] = (), config: NgramConfig = NgramConfig()):
        self.config = config
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        """n-gram -> the index of its last token in its most recent indexed occurrence."""
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        self._index_ending_at(len(self.tokens) - 1)
        self.tokens.append(token)

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (a resume from an earlier point)."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"length {length} outside the history (0..{len(self.tokens)})")
        kept = self.tokens[:length]
        self.tokens, self._last_end = [], {}
        self.extend(kept)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the history's suffix;
        [] when no suffix of min_n tokens or more occurred before."""
        if k <= 0:
            return []
        end = len(self.tokens) - 1
        for n in range(min(self.config.max_n, len(self.tokens)), self.config.min_n - 1, -1):
            earlier = self._last_end.get(tuple(self.tokens[end - n + 1:]))
            if earlier is not None:
                return self._continuation(earlier + 1, k)
        return []

    def _continuation(self, start: int, k: int) -> list[int]:
        """k tokens from start on; where they run into the present, the same period goes
        on (a match ending p tokens back predicts a loop of period p: a model repeating
        itself, "a b a b" -> "a b")."""
        draft = self.tokens[start:start + k]
        period = len(self.tokens) - start
        while len(draft) < k:
            draft.append(draft[len(draft) - period])
        return draft

    def _index_ending_at(self, end: int) -> None:
        for n in range(self.config.min_n, self.config.max_n + 1):
            if end - n + 1 < 0:
                break
            self._last_end[tuple(self.tokens[end - n + 1:end + 1])] = end
