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
    """One request's matcher and the tokens it has consumed.

    With speculative decoding a step samples one row after each drafted token: row i's output
    is the request's output plus drafts 1..i. The matcher follows the rows forward and, at
    the next step, rolls back to what the request really kept (the common prefix), so every
    row is masked as plain decoding would mask it there. A draft the grammar refuses cannot
    be accepted (the row before it samples from a mask without it), so the rows after it are
    discarded whatever their mask."""

    def __init__(self, matcher: "Future | object", vocab_size: int):
        self._matcher = matcher
        """The LLMatcher, or the Future of one still compiling (Grammars.constraint)."""
        self.vocab_size = vocab_size
        self.seen: list[int] = []
        """The tokens the matcher has consumed, in order."""
        self.lost = False
        """The output holds a token the grammar refused: every token is allowed from then."""
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

    def allowed(self, output_ids: list[int], num_drafts: int = 0) -> torch.Tensor | None:
        """(vocab,) bool: the tokens the grammar allows after `output_ids`, whose last
        num_drafts tokens are drafts still to be verified; None when the output holds a token
        the grammar refuses (every token is then allowed, and the log says why) or a draft
        it refuses (the row is discarded)."""
        if self.lost:
            return None
        self._rewind_to(output_ids)
        new = output_ids[len(self.seen):]
        taken = self.matcher.try_consume_tokens(new) if new else 0
        self.seen.extend(new[:taken])
        if taken < len(new):
            if len(self.seen) < len(output_ids) - num_drafts:
                self.lost = True
                log.warning("grammar state lost: token %d refused after %d output tokens",
                            new[taken], len(self.seen))
            return None
        if self.matcher.is_error():
            return None
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def _rewind_to(self, output_ids: list[int]) -> None:
        """Roll the matcher back to the longest common prefix of what it consumed and
        output_ids (rejected drafts; a preempted request's output recomputed)."""
        if output_ids[:len(self.seen)] == self.seen:  # the usual case: the output grew
            return
        same = 0
        for seen, token in zip(self.seen, output_ids):
            if seen != token:
                break
            same += 1
        if not self.matcher.rollback(len(self.seen) - same):
            self.matcher.reset()
            self.matcher.consume_tokens(self.seen[:same])
        del self.seen[same:]
