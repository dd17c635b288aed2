"""Log-probabilities in the shapes the OpenAI SDKs parse: chat's `logprobs.content[]`
(token, logprob, bytes, top_logprobs) and the legacy completions' parallel lists (tokens,
token_logprobs, top_logprobs as token -> logprob, text_offset)."""

from __future__ import annotations

from tokstream.engine.messages import TokenLogprobs
from tokstream.tokenizer import Tokenizer


def _piece(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                  logprobs: list[TokenLogprobs]) -> dict:
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        text, raw = _piece(tokenizer, token_id)
        top = []
        for alt_id, alt in zip(lp.top_token_ids, lp.top_logprobs):
            alt_text, alt_raw = _piece(tokenizer, alt_id)
            top.append({"token": alt_text, "logprob": alt, "bytes": alt_raw})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                        logprobs: list[TokenLogprobs], text_offset: int = 0) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text, _ = _piece(tokenizer, token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_piece(tokenizer, alt)[0]: value
                     for alt, value in zip(lp.top_token_ids, lp.top_logprobs)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
