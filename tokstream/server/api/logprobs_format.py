"""Log-probabilities in the shapes the OpenAI SDKs parse: the legacy completions' parallel
lists (tokens, token_logprobs, top_logprobs as token -> logprob, text_offset), and each token's
text and bytes, which chat's `logprobs.content[]` also reports (content_logprobs.py)."""

from __future__ import annotations

from tokstream.engine.messages.worker import TokenLogprobs
from tokstream.text.tokenizer import Tokenizer


def token_piece(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """(text, bytes) of one token as logprobs report it."""
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                        logprobs: list[TokenLogprobs], text_offset: int = 0) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text, _ = token_piece(tokenizer, token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_piece(tokenizer, alt)[0]: value
                     for alt, value in zip(lp.top_token_ids, lp.top_logprobs)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
