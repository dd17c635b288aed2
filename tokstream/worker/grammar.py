"""Structured outputs on the worker: one llguidance matcher per constrained request, and the
mask of tokens its grammar allows next.

A matcher's state is a function of the output so far, which the worker keeps by position
(RequestState.history): before each mask it consumes the output tokens it has not seen. A
request preempted or resumed on a restarted replica is relearned with its whole history, so
its new matcher replays the same tokens and the stream still ends valid.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

log = logging.getLogger("tokstream.worker")


class Grammars:
    """The model's tokenizer as llguidance sees it and the matchers made from it, both built on
    a thread of their own so that no step waits for them.

    The tokenizer (~0.3-0.5 s for SmolLM2's, holding the GIL) is built from construction, as
    the rank loads: built by the first constrained request inside a step, it stalled every
    stream in that step. A matcher is compiled from when the rank learns its request
    (llguidance drops the GIL while compiling, bounded by its fuel limits), beside that
    step's forward pass; only the step that samples the request's first token waits for
    what is left of it."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._tokenizer = self._compiler.submit(self._build_tokenizer, tokenizer_json,
                                                vocab_size, list(eos_token_ids))

    @staticmethod
    def _build_tokenizer(tokenizer_json: Callable[[], str], vocab_size: int, eos: list[int]):
        from llguidance import LLTokenizer

        return LLTokenizer(tokenizer_json(), n_vocab=vocab_size, eos_token=eos)

    def _compile(self, grammar: str):
        from llguidance import LLMatcher

        return LLMatcher(self._tokenizer.result(), grammar, log_level=0)

    def constraint(self, grammar: str) -> "Constraint":
        """The request's constraint, its matcher compiling meanwhile (FIFO, one thread)."""
        return Constraint(self._compiler.submit(self._compile, grammar), self.vocab_size)


class Constraint:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher: "Future | object", vocab_size: int):
        self._matcher = matcher
        """The LLMatcher, or the Future of one still compiling (Grammars.constraint)."""
        self.vocab_size = vocab_size
        self.consumed = 0
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    @property
    def compiled(self) -> bool:
        return not isinstance(self._matcher, Future) or self._matcher.done()

    @property
    def matcher(self):
        """The LLMatcher, waited for if it is still compiling."""
        if isinstance(self._matcher, Future):
            self._matcher = self._matcher.result()
        return self._matcher

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
