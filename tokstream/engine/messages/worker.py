"""What the engine core and its workers (the rank group) say to each other. Only what
changed since the last step crosses.

core -> worker: StepPlan | ScoreRequest.  worker -> core: StepResult | ScoreResult.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must forget and relearn after a preemption). The
    worker samples each of its tokens with its SamplingParams as the gateway checked them,
    whole (SamplingRow.settings): a new sampling option is a field there and its use in the
    sampler, nothing between."""

    request_id: str
    params: SamplingParams
    seed: int
    """The request's seed (params.seed, or the one the core drew for it at admission)."""
    num_prompt_tokens: int = 0
    """Positions below this are the prompt: penalties tell prompt from output by position,
    so a request re-prefilled after a preemption or a restart counts the same tokens."""
    scores_prompt: bool = False
    """Score the prompt (params.prompt_logprobs) from the prefill's own hidden states; False
    also once the request has output: its prompt was scored before its first token."""
    history: list[int] = field(default_factory=list)
    """For a penalised or constrained request: its tokens at the positions before its first
    chunk (a cached prefix the worker is not sent), so the worker knows every token the
    penalties count and the grammar has consumed."""

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives to return with each prompt token's log-probability; None: none."""
        return self.params.prompt_logprobs if self.scores_prompt else None


@dataclass
class ScheduledChunk:
    """Tokens of one request to run through the model in this step."""

    request_id: str
    token_ids: list[int]
    """The tokens to compute: a prefill chunk, or the one last-sampled token in decode."""
    start_position: int
    """Position of token_ids[0]; the cache already holds positions [0, start_position)."""
    new_block_ids: list[int]
    """Blocks appended to this request's block table before this step runs."""
    sample_index: int | None
    """Output index of the token to sample after this chunk; None for a non-final prefill chunk."""
    next_prompt_token: int | None = None
    """The prompt token right after this chunk, for a request scoring its prompt: what the
    chunk's last position predicts (None when the chunk ends the prompt or nobody asked)."""
    num_draft_tokens: int = 0
    """Speculative decoding: the last this many of token_ids are drafted guesses. A token is
    sampled after each of the chunk's last 1 + num_draft_tokens positions, at output indices
    sample_index, sample_index + 1, ...; the core keeps those the drafts agree with."""
    kept_blocks: int | None = None
    """The request's block table keeps only its first kept_blocks entries before
    new_block_ids are appended (the core freed blocks of rejected drafted positions); None:
    it keeps all."""


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    """Decode chunks (one token) first, then prefill chunks."""
    finished_ids: list[str] = field(default_factory=list)
    """Requests the worker should forget (finished, aborted or preempted)."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(pool block, host block): copy to host memory first, before anything else this step;
    the pool blocks may already belong to another request in this step's chunks."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, pool block): copy back into the pool after swap_out, before the forward
    pass."""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class TokenLogprobs:
    """One sampled token's log-probability under the model, and the most likely tokens'."""

    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int | None = None
    """1-based rank of the token among the vocabulary by log-probability (prompt tokens; None
    where not computed)."""


@dataclass
class PromptLogprobs:
    """A chunk's prompt tokens scored: the log-probability of prompt token first_index + i
    given the tokens before it is logprobs[i]."""

    request_id: str
    first_index: int
    """Prompt index of logprobs[0]'s token (at least 1: the first token has no context)."""
    logprobs: list[TokenLogprobs]


@dataclass
class GrammarFailure:
    """A constrained request whose grammar failed to compile on rank 0. The request alone
    ends, with an invalid_request error."""

    request_id: str
    message: str
    """Why, for its caller."""


@dataclass
class StepResult:
    step_id: int
    sampled_token_ids: list[int]
    """One token per chunk with a sample_index (1 + num_draft_tokens for a chunk with
    drafts), in chunk order; none for the chunks of grammar_pending and grammar_failures."""
    execute_s: float = 0.0
    """Worker-side time for the forward pass and sampling."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """Beside sampled_token_ids where any request asked for log-probabilities (None for the
    others); empty when none did."""
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    """The prompt positions this step scored, per chunk of a request that asked."""
    grammar_pending: list[str] = field(default_factory=list)
    """Requests whose chunk sampled nothing: their grammar was still compiling on rank 0's
    grammar thread, and sampling would have made every stream of the step wait for it. The
    core computes each one's last position again in a later step, which samples (or ends
    the request once its grammar has compiled for EngineConfig.grammar_compile_timeout_s)."""
    grammar_failures: list[GrammarFailure] = field(default_factory=list)
    """Requests whose chunk sampled nothing because their grammar failed to compile."""


@dataclass
class ScoreRequest:
    """core -> worker: run token_ids through the model in one teacher-forced pass."""

    token_ids: list[int]
    block_ids: list[int]
    """Pool blocks lent by the core's block manager for this pass (enough for every token);
    the core takes them back afterwards."""
    start: int
    """Score positions start..len(token_ids)-1: token i against the logits after token i-1."""


@dataclass
class ScoreResult:
    """worker -> core: per scored position, the chosen token's logit and the top logit."""

    token_logits: list[float]
    top_logits: list[float]
    top_token_ids: list[int]
    execute_s: float = 0.0
    error: str | None = None
    """Set when the pass failed on the worker (the replica itself is still fine)."""
