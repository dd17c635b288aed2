"""Incremental detokenisation: token ids in, text deltas out, safe to stream.

Two layers, each holding back what it cannot yet vouch for:
- UTF-8: byte-level tokens can end inside a character. Each step decodes only a small window
  (from `prefix_offset`: a few tokens of context, then the unconfirmed tokens), so the cost per
  token does not grow with the output. Lossy UTF-8 decoding only ever rewrites its last
  replacement character when more bytes arrive, so all text but a trailing U+FFFD is final.
- Stop strings: text that could be the start of a stop string is held until it cannot be, so
  no partial stop string is ever streamed; the stop string itself is emitted only when the
  request asks (include_stop_str_in_output). A request's first min_tokens tokens are not
  looked at: their text goes out as it comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokstream.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Tokens of already-seen text decoded before the new ones: enough for a tokenizer whose
# decoding of a token depends on its neighbours (sentencepiece drops a leading space).
CONTEXT_TOKENS = 6


@dataclass(frozen=True)
class DetokenizerStep:
    text: str
    """New text safe to show now (may be empty)."""
    stop: str | None = None
    """The stop string that ended the output, or None."""


class IncrementalDetokenizer:
    """One request's output stream.

    `prompt_ids`: the prompt, used only as decoding context, never emitted.
    `delivered_ids`: output ids already delivered by an earlier detokenizer (resumption); the
    stream continues exactly as the uninterrupted one would have.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, prompt_ids: Sequence[int] | None = None,
                 delivered_ids: Sequence[int] | None = None, include_stop: bool = False,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop if s]
        self.include_stop = include_stop
        """Release the stop string that ends the output as its last text."""
        self.min_tokens = min_tokens
        """Output tokens whose text is released unchecked: stop strings are looked for in
        the text of later tokens only (vLLM's min_tokens)."""
        self.num_output = len(delivered_ids or ())
        self.skip_special_tokens = skip_special_tokens
        self.finished = False
        self.stop: str | None = None
        delivered = list(delivered_ids or ())
        # Window state: ids[prefix_offset:read_offset] is confirmed context whose text is
        # `prefix_len` chars; `emitted_extra` chars decoded past it were already released.
        # A window may start inside a character: its stray bytes decode to the same U+FFFD
        # every step, so counting them as released keeps every later delta exact.
        self.ids = list(prompt_ids or ()) + delivered
        self.prefix_offset = self.read_offset = max(len(self.ids) - CONTEXT_TOKENS, 0)
        self.prefix_len = 0
        self.emitted_extra = len(_stable(self._decode(self.ids[self.prefix_offset:])))
        # Released by the UTF-8 layer but held by the stop layer.
        self.pending = self._pending_after(delivered) if self.stop_strings else ""

    def step(self, new_token_ids: Sequence[int]) -> DetokenizerStep:
        if self.finished:  # a stop is reported once; later tokens are not shown
            return DetokenizerStep("")
        self.ids.extend(new_token_ids)
        self.num_output += len(new_token_ids)
        if self.num_output <= self.min_tokens:  # nothing is held yet: pending is empty
            return DetokenizerStep(self._utf8_delta())
        return self._release(self._utf8_delta())

    def finish(self) -> str:
        """Everything still held, when the request ends for any reason but a stop string."""
        if self.finished:
            return ""
        self.finished = True
        full = self._decode(self.ids[self.prefix_offset:])
        text = self.pending + full[self.prefix_len + self.emitted_extra:]
        self.pending = ""
        return text

    def _utf8_delta(self) -> str:
        full = self._decode(self.ids[self.prefix_offset:])
        delta = _stable(full)[self.prefix_len + self.emitted_extra:]
        if not full.endswith(REPLACEMENT):
            # Everything decoded is final: slide the window so it stays a few tokens long.
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.prefix_len = len(self._decode(self.ids[self.prefix_offset:self.read_offset]))
            self.emitted_extra = 0
        else:
            self.emitted_extra += len(delta)
        return delta

    def _release(self, delta: str) -> DetokenizerStep:
        if not self.stop_strings:
            return DetokenizerStep(delta)
        text = self.pending + delta
        hit = _first_stop(text, self.stop_strings)
        if hit is not None:
            start, self.stop = hit
            self.finished = True
            self.pending = ""
            end = start + len(self.stop) if self.include_stop else start
            return DetokenizerStep(text[:end], self.stop)
        held = _stop_prefix_len(text, self.stop_strings)
        self.pending = text[len(text) - held:]
        return DetokenizerStep(text[:len(text) - held])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending_after(self, delivered: list[int]) -> str:
        """What an uninterrupted stream would still hold for the stop layer after `delivered`."""
        # Up to 3 stray bytes of a character cut by the window's start decode to U+FFFD: decode
        # enough that the longest possible hold stays clear of them.
        needed = max(len(s) for s in self.stop_strings) + 3
        context = CONTEXT_TOKENS
        checked_from = min(self.min_tokens, len(delivered))  # the text held back starts here
        while True:
            start = max(len(delivered) - context, checked_from)
            tail = _stable(self._decode(delivered[start:]))
            if start == checked_from or len(tail) >= needed:
                break
            context *= 2
        held = _stop_prefix_len(tail, self.stop_strings)
        return tail[len(tail) - held:]


def _stable(text: str) -> str:
    """The part of a lossy decode that more bytes cannot change."""
    return text[:-1] if text.endswith(REPLACEMENT) else text


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string that completes first in `text`.

    Earliest end, not earliest start, so the answer does not depend on how the text was cut
    into steps; among those ending together, the longest.
    """
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), start)
            if best is None or key < best[0]:
                best = (key, stop)
    return None if best is None else (best[0][1], best[1])


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for length in range(min(len(text), max(len(s) for s in stops) - 1), 0, -1):
        suffix = text[-length:]
        if any(s.startswith(suffix) for s in stops):
            return length
    return 0
