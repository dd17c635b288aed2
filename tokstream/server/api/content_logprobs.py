"""Chat `logprobs.content` that adds up to the text: one entry per token whose text the output
shows, listed once that text has been released, so the entries' bytes concatenate to the
message's content (streamed: to the content deltas, chunk after chunk).

A token the text never shows is not listed: the end-of-turn token (`<|im_end|>`) and any other
special token (the detokeniser skips them), an id the vocabulary lacks, and the tokens of a
matched stop string. vLLM lists every sampled token instead, the stop token with its special
text, which is how its entries come to end in `<|im_end|>` while the content does not. A token
that a stop string cuts is listed with the part of its text the content keeps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokstream.engine.messages.worker import TokenLogprobs
from tokstream.server.api.logprobs_format import token_piece
from tokstream.text.tokenizer import Tokenizer


@dataclass
class PendingToken:
    """A sampled token whose text has not been released yet."""

    token_id: int
    logprobs: TokenLogprobs
    text_bytes: bytes
    """What the token adds to the output text (b"" for a token the text skips)."""


@dataclass
class ContentLogprobs:
    """One choice's entries, fed each batch of tokens with the text released beside them."""

    tokenizer: Tokenizer
    pending: deque[PendingToken] = field(default_factory=deque)
    """Tokens in output order whose text has not been matched yet."""
    text: bytearray = field(default_factory=bytearray)
    """The text released so far (UTF-8)."""
    covered: int = 0
    """How much of text the listed entries cover."""
    aligned: bool = True
    """Whether the tokens' bytes have matched the text so far. A tokenizer whose pieces are
    not the text's bytes (sentencepiece's "▁" for a space) ends it: from then on every token
    but the special ones is listed as it comes, as before this alignment existed."""
    specials: frozenset[str] = frozenset()

    def __post_init__(self):
        self.specials = frozenset(self.tokenizer.special_strings)

    def feed(self, token_ids: list[int], logprobs: list[TokenLogprobs], text: str) -> list[dict]:
        """The entries that the text released so far now covers."""
        self.pending.extend(PendingToken(t, lp, self._text_bytes(t))
                            for t, lp in zip(token_ids, logprobs))
        self.text += text.encode("utf-8")
        return self._covered()

    def finish(self) -> list[dict]:
        """The output ended: what is left is never shown, but for a token cut by a stop string."""
        entries = self._covered()
        if self.pending and self.aligned and self.covered < len(self.text):
            entries.append(self._entry(self.pending[0], bytes(self.text[self.covered:])))
        self.pending.clear()
        self.covered = len(self.text)
        return entries

    def _text_bytes(self, token_id: int) -> bytes:
        spelled = self.tokenizer.id_to_token(token_id)
        if spelled is None or spelled in self.specials:
            return b""
        return self.tokenizer.token_bytes(token_id)

    def _covered(self) -> list[dict]:
        entries = []
        while self.pending:
            token = self.pending[0]
            piece = token.text_bytes
            if piece and self.aligned and not self.text.startswith(piece, self.covered):
                if piece.startswith(self.text[self.covered:]):
                    break  # its text is still held back (a character or a stop string unsure)
                # A stray byte shows as U+FFFD in the text: still aligned past it.
                piece = piece.decode("utf-8", errors="replace").encode("utf-8")
                self.aligned = self.text.startswith(piece, self.covered)
            self.pending.popleft()
            if piece:
                entries.append(self._entry(token))
                self.covered = min(self.covered + len(piece), len(self.text))
        return entries

    def _entry(self, token: PendingToken, shown: bytes | None = None) -> dict:
        if shown is None:
            text, raw = token_piece(self.tokenizer, token.token_id)
        else:
            text, raw = shown.decode("utf-8", errors="replace"), list(shown)
        top = []
        for alt_id, alt in zip(token.logprobs.top_token_ids, token.logprobs.top_logprobs):
            alt_text, alt_raw = token_piece(self.tokenizer, alt_id)
            top.append({"token": alt_text, "logprob": alt, "bytes": alt_raw})
        return {"token": text, "logprob": token.logprobs.logprob, "bytes": raw,
                "top_logprobs": top}
