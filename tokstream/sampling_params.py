"""How one request's tokens are chosen and when it stops. Validated on construction; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.body_bounds import Bound, check_bounds, on_apis
from tokstream.errors import UserInputError
from tokstream.structured import StructuredOutput

MAX_LOGPROBS = 20
"""Most alternatives per token (OpenAI's top_logprobs limit)."""


@dataclass
class SamplingParams:
    """Per-request generation settings (what the API bodies and CLI flags map to)."""

    max_tokens: int = 256
    """Most output tokens to generate."""
    temperature: float = field(default=1.0, metadata={"body": on_apis(
        openai=Bound(0, 2), anthropic=Bound(0, 1))})
    """0 means greedy.

    The logits are divided by it after logit_bias and the penalties, before min_p, top_k and
    top_p drop tokens (vLLM's order; tokstream/worker/sampler.py)."""
    top_p: float = field(default=1.0, metadata={"body": on_apis(
        both=Bound(0, 1, exclusive_minimum=True))})
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = field(default=0, metadata={"body": on_apis(
        openai=Bound(-1, integer=True, description="vLLM extension; -1 or 0 = off"),
        anthropic=Bound(0, integer=True))})
    """Keep only the k most likely tokens; 0 (or -1, as vLLM takes it) means no limit."""
    seed: int | None = field(default=None, metadata={"body": on_apis(
        both=Bound(0, 2**63 - 1, integer=True, description="tokstream extension"))})
    """Randomness is a pure function of (seed, output position); None gets one at admission."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the text; never streamed, not even partially."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (in addition to the model's end-of-sequence ids)."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence tokens (benchmarks)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    include_stop_str_in_output: bool = False
    """End the text with the stop string that ended it (by default it is left out)."""
    min_tokens: int = 0
    """Output tokens before the request may end: until then no end-of-sequence or stop
    token id is sampled and stop strings are not looked for (vLLM's meaning)."""
    min_p: float = field(default=0.0, metadata={"body": on_apis(
        openai=Bound(0, 1, description="vLLM extension"))})
    """Drop tokens whose probability is below min_p times the most likely one's (after
    temperature); 0 keeps all."""
    top_n_sigma: float = field(default=0.0, metadata={"body": on_apis(openai=Bound(
        0, description="Top-n-sigma: keep the tokens whose logit is within n standard "
                       "deviations of the largest; 0 = off"))})
    """Top-nσ (Tang et al., 2024): drop tokens whose logit is more than n standard deviations
    (over the vocabulary) below the largest; the same at any temperature. 0 keeps all."""
    presence_penalty: float = field(default=0.0, metadata={"body": on_apis(
        openai=Bound(-2, 2))})
    """Subtracted once from the logit of every token already in the output (OpenAI)."""
    frequency_penalty: float = field(default=0.0, metadata={"body": on_apis(
        openai=Bound(-2, 2))})
    """Subtracted from a token's logit once per time it is already in the output (OpenAI)."""
    repetition_penalty: float = field(default=1.0, metadata={"body": on_apis(
        openai=Bound(0, 10, exclusive_minimum=True, description="vLLM extension"))})
    """Divides positive logits and multiplies negative ones of every token in the prompt or
    the output (Hugging Face, vLLM); 1 is off."""
    allowed_token_ids: list[int] = field(default_factory=list)
    """The only token ids that may be sampled (vLLM's); empty: any."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    """Token sequences the output may not contain (vLLM's bad_words, tokenised): a sequence's
    last token is banned wherever the output ends with the ones before it."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> added to its logit before sampling (OpenAI, -100 to 100)."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (None: free)."""
    grammar: str = ""
    """The llguidance grammar of `structured`, compiled and checked here ('' when free)."""
    logprobs: int | None = None
    """Return each output token's log-probability under the model (raw logits, float32
    log-softmax) with this many most likely alternatives (0-20); None returns none."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log-probability given the tokens before it (the first's is
    None), with this many most likely alternatives (0-20), computed in the prompt's own prefill;
    None returns none. Such a request takes no prefix-cache hits until its prompt is scored."""

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise UserInputError("max_tokens must be an integer")
        if self.max_tokens < 1:
            raise UserInputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise UserInputError(f"min_tokens must be an integer in [0, max_tokens = "
                                 f"{self.max_tokens}], got {self.min_tokens!r}")
        out_of_bounds = check_bounds(self)
        if out_of_bounds:
            raise UserInputError(out_of_bounds)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserInputError("stop sequences must be non-empty strings")
        if any(not words or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                for t in words) for words in self.bad_words_token_ids):
            raise UserInputError("bad_words_token_ids: each must be a non-empty list of token "
                                 "ids")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise UserInputError(f"logit_bias: token ids must be integers >= 0, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise UserInputError(f"logit_bias: each bias must be in [-100, 100], got {bias}")
        if self.structured is not None and not self.grammar:
            self.grammar = self.structured.grammar()
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise UserInputError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise UserInputError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {self.prompt_logprobs!r}")

    @property
    def needs_history(self) -> bool:
        """Whether the token history changes the logits (penalties, a grammar's state): the
        worker then keeps it."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.grammar)
                or any(len(words) > 1 for words in self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processed(self) -> bool:
        """Whether anything but temperature, top_k and top_p changes the logits (the sampler
        then processes the row by itself)."""
        return (bool(self.logit_bias) or bool(self.grammar) or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or (self.min_p > 0.0 and not self.greedy) or self.min_tokens > 0
                or bool(self.allowed_token_ids) or bool(self.bad_words_token_ids))
