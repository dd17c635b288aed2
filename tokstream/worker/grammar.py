"""Structured outputs on the worker: one llguidance matcher per constrained request, and the
mask of tokens its grammar allows next.

A matcher's state is a function of the output so far, which the worker keeps by position
(RequestState.history): before each mask it consumes the output tokens it has not seen. A
request preempted or resumed on a restarted replica is relearned with its whole history, so
its new matcher replays the same tokens and the stream still ends valid.

No step waits for a grammar: a request whose matcher still compiles when a step would sample
its token is held back (Grammars.hold_back), its stream and every other go on, and the core
computes its last position again in a later step, which samples it (or ends the request once
its grammar has compiled for longer than EngineConfig.grammar_compile_timeout_s). A compile
that fails ends its request alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Callable

import numpy as np
import torch

from tokstream import envs
from tokstream.engine.messages.worker import GrammarFailure

log = logging.getLogger("tokstream.worker")

IDLE_WAIT_S = 0.05
"""A step whose every sampled row waits for a grammar waits this long for one to compile
before handing them back: no other stream's token is held up by it, and the core does not
spin one-token steps that take the CPU from the compile."""
GATE_WAIT_S = 60.0
"""The longest a compile waits for the test hook's gate file (envs.GRAMMAR_GATE)."""


def on_thread(name: str, build: Callable, *args) -> Future:
    """build(*args) on a daemon thread of its own. llguidance cannot stop a compile, so one
    past its limit runs on: it must hold up neither the compiles after it nor the rank's
    exit."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(build(*args))
        except BaseException as exc:  # the request's failure, reported by hold_back
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class Grammars:
    """The model's tokenizer as llguidance sees it and the matchers made from it, both built on
    threads of their own so that no step waits for them.

    The tokenizer (~0.3-0.5 s for SmolLM2's, holding the GIL) is built from construction, as
    the rank loads: built by the first constrained request inside a step, it stalled every
    stream in that step. A matcher is compiled from when the rank learns its request
    (llguidance drops the GIL while compiling, bounded by its fuel limits), beside the steps'
    forward passes; a step samples the request only once it is ready (hold_back)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._tokenizer = on_thread("grammar-tokenizer", self._build_tokenizer, tokenizer_json,
                                    vocab_size, list(eos_token_ids))

    @staticmethod
    def _build_tokenizer(tokenizer_json: Callable[[], str], vocab_size: int, eos: list[int]):
        from llguidance import LLTokenizer

        return LLTokenizer(tokenizer_json(), n_vocab=vocab_size, eos_token=eos)

    def _compile(self, grammar: str):
        from llguidance import LLMatcher

        _pass_gate()
        matcher = LLMatcher(self._tokenizer.result(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def constraint(self, grammar: str) -> "Constraint":
        """The request's constraint, its matcher compiling meanwhile on a thread of its own."""
        return Constraint(on_thread("grammar", self._compile, grammar), self.vocab_size)

    def hold_back(self, sampled: dict[str, "Constraint | None"]
                  ) -> tuple[list[str], list[GrammarFailure]]:
        """Of the requests a step samples (request id -> its constraint, None if it has none),
        those it must not sample: (ids whose matcher still compiles, those whose grammar
        failed). Where every one of them waits for a grammar, waits IDLE_WAIT_S first for any
        to compile."""
        unready = [c.compiling for c in sampled.values() if c is not None and not c.compiled]
        if unready and len(unready) == len(sampled):
            wait(unready, IDLE_WAIT_S, FIRST_COMPLETED)
        pending, failures = [], []
        for request_id, constraint in sampled.items():
            if constraint is None:
                continue
            problem = constraint.failure()
            if problem is not None:
                failures.append(GrammarFailure(request_id, problem))
            elif not constraint.compiled:
                pending.append(request_id)
        return pending, failures


def _pass_gate() -> None:
    """Tests only (envs.GRAMMAR_GATE): hold the compile until the gate file exists."""
    gate = envs.GRAMMAR_GATE.get()
    if not gate:
        return
    give_up = time.monotonic() + GATE_WAIT_S
    while not os.path.exists(gate) and time.monotonic() < give_up:
        time.sleep(0.01)


class Constraint:
    """One request's matcher and the tokens it has consumed.

    With speculative decoding a step samples one row after each drafted token: row i's output
    is the request's output plus drafts 1..i. The matcher follows the rows forward and, at
    the next step, rolls back to what the request really kept (the common prefix), so every
    row is masked as plain decoding would mask it there. A draft the grammar refuses cannot
    be accepted (the row before it samples from a mask without it), so the rows after it are
    discarded whatever their mask."""

    def __init__(self, compiling: Future, vocab_size: int):
        self.compiling = compiling
        """The LLMatcher's Future (Grammars.constraint)."""
        self.vocab_size = vocab_size
        self.seen: list[int] = []
        """The tokens the matcher has consumed, in order."""
        self.lost = False
        """The output holds a token the grammar refused: every token is allowed from then."""
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    @property
    def compiled(self) -> bool:
        """The compile has ended (with a matcher, or failed: see failure)."""
        return self.compiling.done()

    @property
    def matcher(self):
        """The LLMatcher, waited for if it is still compiling (a step asks only once it is
        compiled: Grammars.hold_back)."""
        return self.compiling.result()

    def failure(self) -> str | None:
        """Why the request cannot be sampled under its grammar: its compile failed (None
        while it compiles, or once it has compiled)."""
        if not self.compiling.done() or self.compiling.exception() is None:
            return None
        return f"structured output: the grammar failed to compile: {self.compiling.exception()}"

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
