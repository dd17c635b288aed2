"""Prompt log-probabilities on /v1/completions, in vLLM's shapes: `echo` shows the prompt
before the output, and with `logprobs` its tokens lead the lists (the first token's logprob and
top_logprobs null: nothing precedes it); `max_tokens: 0` with echo returns the prompt alone;
`prompt_logprobs` (vLLM's extra parameter) is a list per prompt token of
{token_id: {logprob, rank, decoded_token}}, the first entry null. What lm-eval's
local-completions sends for loglikelihood (`echo: true, logprobs: 1, max_tokens: 1`) reads its
answer from these lists.

The engine scores the prompt in the prompt's own prefill (SamplingParams.prompt_logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

from tokstream.engine.messages.worker import TokenLogprobs
from tokstream.server.api.logprobs_format import completion_logprobs, token_piece
from tokstream.text.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0
"""What a log-probability of -inf is written as (JSON has no infinity; vLLM and OpenAI write
this)."""


@dataclass(frozen=True)
class Echo:
    """How a completion echoes its prompt."""

    text: str
    """The prompt as echoed: the caller's string, or its token ids decoded."""
    prompt_only: bool = False
    """max_tokens 0: the engine samples one token (as vLLM does) that the caller is not
    shown."""


def _floor(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def prompt_part(tokenizer: Tokenizer, prompt_ids: list[int],
                prompt_logprobs: list[TokenLogprobs | None], num_top: int,
                text_offset: int = 0) -> dict:
    """The completions lists (tokens, token_logprobs, top_logprobs, text_offset) for the
    prompt: each top_logprobs entry holds the prompt token itself, then the num_top most
    likely (vLLM's top num_top + 1)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(prompt_ids, prompt_logprobs):
        text = token_piece(tokenizer, token_id)[0]
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_floor(lp.logprob))
        top = {text: _floor(lp.logprob)}
        for alt, value in zip(lp.top_token_ids[:num_top], lp.top_logprobs):
            top.setdefault(token_piece(tokenizer, alt)[0], _floor(value))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def echoed(echo: Echo, tokenizer: Tokenizer, prompt_ids: list[int], num_top: int | None,
           prompt_logprobs: list[TokenLogprobs | None] | None, token_ids: list[int],
           logprobs: list[TokenLogprobs], output_text: str) -> tuple[str, dict | None]:
    """(text, logprobs) of a choice that echoes its prompt: the prompt, then the output (none
    when prompt_only); the logprobs cover both (None when the request did not ask)."""
    shown_ids, shown_text = ([], "") if echo.prompt_only else (token_ids, output_text)
    text = echo.text + shown_text
    if num_top is None:
        return text, None
    lists = prompt_part(tokenizer, prompt_ids, prompt_logprobs or [None] * len(prompt_ids),
                        num_top)
    end = lists["text_offset"][-1] + len(lists["tokens"][-1]) if prompt_ids else 0
    output = completion_logprobs(tokenizer, shown_ids, logprobs, end)
    return text, {key: lists[key] + output[key] for key in lists}


def prompt_logprobs_field(tokenizer: Tokenizer, prompt_ids: list[int],
                          prompt_logprobs: list[TokenLogprobs | None] | None) -> list:
    """vLLM's `prompt_logprobs` of a choice: per prompt token None (the first) or
    {token_id: {logprob, rank, decoded_token}} for the token itself and the most likely ones."""
    out: list[dict | None] = []
    for token_id, lp in zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids)):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token_id): {"logprob": _floor(lp.logprob), "rank": lp.rank,
                                 "decoded_token": token_piece(tokenizer, token_id)[0]}}
        for rank, (alt, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), 1):
            entry.setdefault(str(alt), {"logprob": _floor(value), "rank": rank,
                                        "decoded_token": token_piece(tokenizer, alt)[0]})
        out.append(entry)
    return out
