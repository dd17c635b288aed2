"""A lower bound on the tokens a text encodes to, from its length alone, so that a prompt far
past the context is refused before it is tokenised: 2 MB of tool results took 1.2 s of a core
to tokenise (issue 31 item 4, a core the rank's streams lost) only to end in a 400. No torch
here."""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from tokstream.errors import PromptTooLongError


def max_token_bytes(backend: BackendTokenizer) -> int | None:
    """The most bytes of text one token stands for, where each token stands for its own text
    (BPE, no normalizer); None otherwise: a normalizer such as NFKC may shrink the text, and
    then its length bounds nothing."""
    if backend.normalizer is not None or not isinstance(backend.model, models.BPE):
        return None
    # A byte-level piece's characters are a byte each; elsewhere the UTF-8 spelling bounds the
    # bytes (SentencePiece's "\u2581" and "<0x0A>" each stand for one byte).
    byte_level = isinstance(backend.decoder, decoders.ByteLevel)
    pieces = backend.get_vocab(with_added_tokens=False)
    longest = max((len(p) if byte_level else len(p.encode("utf-8")) for p in pieces),
                  default=1)
    added = backend.get_added_tokens_decoder().values()
    return max([longest, *(len(t.content.encode("utf-8")) for t in added)])


def fewest_tokens(num_chars: int, token_bytes: int | None) -> int:
    """Tokens a text of num_chars characters encodes to at least: each character is a byte or
    more, each token token_bytes (max_token_bytes) at most; 0 when that is unknown."""
    return num_chars // token_bytes if token_bytes else 0


def refuse_past(num_chars: int, limit: int | None, token_bytes: int | None) -> None:
    """PromptTooLongError when a text of num_chars characters must encode to limit tokens or
    more (the same refusal check_fits gives once the prompt is tokenised)."""
    fewest = fewest_tokens(num_chars, token_bytes)
    if limit is not None and fewest >= limit:
        raise PromptTooLongError(
            f"the prompt is at least {fewest} tokens ({num_chars} characters); the model's "
            f"context is {limit} tokens, leaving no room for output")
