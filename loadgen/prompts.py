"""Prompts of an exact length in the server's own tokenizer, sized with count_tokens.

Byte-level BPE tokenizers (GPT-2's, Llama's, SmolLM2's, the dummy models') split text into
words with their leading space before merging, so " word" costs the same number of tokens
wherever it stands. We ask the server once what each candidate word costs and keep the words
of the cheapest cost that enough of them share (one token on SmolLM2, two on the dummy
models), plus short punctuation suffixes for a remainder below one word; and once per class
what the chat template, a shared system prompt and the fixed header cost. A prompt of N tokens
is then the header, (N - base) / unit words drawn from the request's own seed, and a suffix:
every request's text differs (no accidental prefix-cache hits) and no length is measured
again, not even 50k. The sizing is checked: each class's shortest and longest prompt are
counted by the server before the run, and every request's reported input tokens are compared
with its target in the report.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from tokstream.errors import UserInputError

HEADER = "Continue:"
# Common English words (one token in most English BPE vocabularies) and single letters (two
# tokens, space and letter, in byte-level vocabularies without merges such as the dummy
# models'). The cheapest cost that enough of them share is the unit of length.
CANDIDATES = (
    "the of and to in is was for on that with as by at from his her they this be or an are "
    "not but had have which one all were when there can more has their if will so would "
    "about into time up other out only new some could these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since "
    "against go came right used take three"
).split() + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Appended after the last word to make up a remainder shorter than one word.
PADS = (".", ",", "!", "?", ";", "..", "!!", "??", ".,", "!?", "...", ",,,", "!!!", ".!?")
MIN_WORDS = 32


@dataclass
class PromptBook:
    """What it takes to write a prompt of any length for each class."""

    words: list[str]
    """Words that cost exactly `word_tokens` tokens each after a space."""
    word_tokens: int
    pads: dict[int, str]
    """Remainder (1 .. word_tokens - 1) -> a suffix costing exactly that many tokens."""
    system: dict[str, str | None]
    """Per class: its shared system prompt (None for none)."""
    base: dict[str, int]
    """Per class: input tokens of the header alone (template, system prompt included)."""

    def user_text(self, workload: str, prompt_tokens: int, rng: random.Random) -> str:
        extra = prompt_tokens - self.base[workload]
        if extra < 0:
            raise ValueError(f"{prompt_tokens} tokens is below class {workload}'s minimum "
                             f"{self.base[workload]}")
        count, remainder = divmod(extra, self.word_tokens)
        words = "".join(" " + w for w in rng.choices(self.words, k=count))
        return HEADER + words + (self.pads[remainder] if remainder else "")

    def row(self) -> dict:
        return {"words": self.words, "word_tokens": self.word_tokens,
                "pads": {str(k): v for k, v in self.pads.items()}, "system": self.system,
                "base": self.base}

    @classmethod
    def from_row(cls, row: dict) -> "PromptBook":
        return cls(row["words"], row["word_tokens"], {int(k): v for k, v in row["pads"].items()},
                   row["system"], row["base"])


def system_prompt(words: list[str], num_words: int, seed: int) -> str:
    """The class's shared system prompt: the same text for every request of the run."""
    rng = random.Random(f"{seed}:system")
    return "You are a helpful assistant. Background:" + "".join(
        " " + w for w in rng.choices(words, k=num_words))


class TokenCounter:
    """POST /v1/messages/count_tokens, remembering each answer (a 50k prompt is sent once)."""

    def __init__(self, client: httpx.Client, url: str, model: str, headers: dict):
        self.client, self.url, self.model, self.headers = client, url, model, headers
        self._cache: dict[tuple[str | None, str], int] = {}

    def __call__(self, user: str, system: str | None = None) -> int:
        key = (system, user)
        if key not in self._cache:
            body = {"model": self.model, "messages": [{"role": "user", "content": user}]}
            if system is not None:
                body["system"] = system
            try:
                response = self.client.post(self.url + "/v1/messages/count_tokens", json=body,
                                            headers=self.headers)
                answer = response.json() if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as error:
                raise UserInputError(f"count_tokens at {self.url}: {error}") from None
            if not isinstance(answer, dict) or not isinstance(answer.get("input_tokens"), int):
                raise UserInputError(f"count_tokens at {self.url} answered "
                                     f"{response.status_code}: {response.text[:200]}")
            self._cache[key] = answer["input_tokens"]
        return self._cache[key]


def calibrate(count: TokenCounter, shared_prefix: dict[str, int], seed: int) -> PromptBook:
    """Find the unit words and the pads, then each class's base cost."""
    header_cost = count(HEADER)
    by_cost: dict[int, list[str]] = {}
    with ThreadPoolExecutor(4) as pool:
        for start in range(0, len(CANDIDATES), 16):
            batch = CANDIDATES[start:start + 16]
            costs = pool.map(lambda w: count(HEADER + " " + w) - header_cost, batch)
            for word, cost in zip(batch, costs):
                by_cost.setdefault(cost, []).append(word)
            if len(by_cost.get(1, ())) >= MIN_WORDS:
                break  # one token a word cannot be beaten
    unit = min((c for c, ws in by_cost.items() if c >= 1 and len(ws) >= MIN_WORDS), default=None)
    if unit is None:
        raise UserInputError("no " + str(MIN_WORDS) + " of our candidate words cost the same "
                             "number of tokens on this server; cannot size prompts exactly")
    words = by_cost[unit]
    pads: dict[int, str] = {}
    if unit > 1:
        after = HEADER + " " + words[0]
        for pad in PADS:
            pads.setdefault(count(after + pad) - count(after), pad)
        missing = [r for r in range(1, unit) if r not in pads]
        if missing:
            raise UserInputError(f"no suffix costs {missing} tokens on this server's tokenizer; "
                                 "cannot size prompts exactly")
        pads = {r: pads[r] for r in range(1, unit)}
    system: dict[str, str | None] = {}
    base: dict[str, int] = {}
    for name, num_words in shared_prefix.items():
        system[name] = system_prompt(words, num_words // unit, seed) if num_words else None
        base[name] = count(HEADER, system[name])
    return PromptBook(words, unit, pads, system, base)


def verify(book: PromptBook, count: TokenCounter, lengths: list[tuple[str, int]],
           seed: int) -> list[dict]:
    """Count a sample of (class, length) prompts on the server; one row per mismatch."""
    mismatches = []
    for workload, length in lengths:
        text = book.user_text(workload, length, random.Random(f"{seed}:verify:{length}"))
        got = count(text, book.system[workload])
        if got != length:
            mismatches.append({"class": workload, "target": length, "counted": got})
    return mismatches
