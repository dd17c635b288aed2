"""Structured outputs on the worker: one llguidance matcher per constrained request, and the
mask of tokens its grammar allows next.

A matcher's state is a function of the output so far, which the worker keeps by position
(RequestState.history): before each mask it consumes the output tokens it has not seen. A
request preempted or resumed on a restarted replica is relearned with its whole history, so
its new matcher replays the same tokens and the stream still ends valid.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

log = logging.getLogger("tokstream.worker")


class Grammars:
    """The model's tokenizer as llguidance sees it, built on the first constrained request
    (~0.3 s for SmolLM2's), and the matchers made from it."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer = None

    def constraint(self, grammar: str) -> "Constraint":
        from llguidance import LLMatcher, LLTokenizer

        if self._tokenizer is None:
            self._tokenizer = LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                          eos_token=self._eos)
        return Constraint(LLMatcher(self._tokenizer, grammar, log_level=0), self.vocab_size)


class Constraint:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    def allowed(self, output_ids: list[int]) -> torch.Tensor | None:
        """(vocab,) bool: the tokens the grammar allows after `output_ids`; None when the
        matcher has failed (a token it could not take: every token is then allowed, and the
        log says why)."""
        if len(output_ids) < self.consumed:  # rewound: replay from the start
            self.matcher.reset()
            self.consumed = 0
        if not self.matcher.consume_tokens(output_ids[self.consumed:]):
            log.warning("grammar state lost: %s", self.matcher.get_error())
        self.consumed = len(output_ids)
        if self.matcher.is_error():
            return None
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self.vocab_size]
        return torch.from_numpy(bits.astype(bool))
