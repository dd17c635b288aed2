"""Plain data crossing process boundaries. Only what changed since the last step crosses.

core -> worker: StepPlan | ScoreRequest.  worker -> core: StepResult | ScoreResult.
core -> clients: RequestDelta.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field

from tokstream.errors import ErrorKind
from tokstream.sampling_params import SamplingParams
from tokstream.wire import WireEnum


def token_digest(token_ids: list[int]) -> str:
    """The integrity digest of an output: sha256 over the ids as little-endian uint32.

    The engine core computes it from its own record of a request's output; a client recomputes
    it from the tokens it received (tokstream.checker), so the path between cannot vouch for
    itself."""
    return "sha256:" + hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()


def poison_message(failures: int, reason: str) -> str:
    """Why a request that kept failing was ended (no 'replica' or 'engine' in it: this is the
    request's own failure, an api_error, not an overload worth retrying elsewhere)."""
    return (f"this request was being computed at each of {failures} failures in a row of the "
            f"model's processes (last: {reason}); it was ended so the others could go on")


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must forget and relearn after a preemption)."""

    request_id: str
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    """Alternatives to return with each sampled token's log-probability; None: none."""
    num_prompt_tokens: int = 0
    """Positions below this are the prompt: penalties tell prompt from output by position,
    so a request re-prefilled after a preemption or a restart counts the same tokens."""
    grammar: str = ""
    """The llguidance grammar the output must follow ('' when free)."""
    history: list[int] = field(default_factory=list)
    """For a penalised or constrained request: its tokens at the positions before its first
    chunk (a cached prefix the worker is not sent), so the worker knows every token the
    penalties count and the grammar has consumed."""


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


@dataclass
class StepResult:
    step_id: int
    sampled_token_ids: list[int]
    """One token per chunk with a sample_index, in chunk order."""
    execute_s: float = 0.0
    """Worker-side time for the forward pass and sampling."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """Beside sampled_token_ids where any request asked for log-probabilities (None for the
    others); empty when none did."""


class FinishReason(WireEnum):
    """Why a request ended (on its last delta)."""

    STOP = "stop"
    """A stop token or stop string."""
    LENGTH = "length"
    """max_tokens, or the model's context."""
    ABORT = "abort"
    """Cancelled by the gateway or the server."""
    ERROR = "error"
    """Failed: see the delta's error and error_kind."""


@dataclass
class RequestDelta:
    """What one request gained in one step; what the gateway streams to its caller."""

    request_id: str
    token_ids: list[int]
    """New output token ids."""
    first_index: int
    """Output index of token_ids[0]: indices are contiguous from 0 across all deltas."""
    text: str
    """New text safe to show (UTF-8 complete, no partial stop string)."""
    finish_reason: str | None = None
    """None while running; 'stop', 'length', 'abort' or 'error' once, on the last delta."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    """Output tokens counted so far, including this delta."""
    error: str | None = None
    """Why the request failed, when finish_reason is 'error'."""
    error_kind: ErrorKind | None = None
    """Who is at fault, set where the failure was caught (None from a producer that does not
    say yet: the gateway then reads it from the message, see server/sse.py)."""
    step_id: int = 0
    """The engine step that produced token_ids (0 for a delta no step produced)."""
    output_digest: str | None = None
    """On the last delta: token_digest() of every output token, from the core's own record."""
    queue_s: float | None = None
    """On the last delta: seconds from arrival to first scheduling (None if never scheduled)."""
    logprobs: list[TokenLogprobs] | None = None
    """Beside token_ids, for a request that asked for log-probabilities."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at first scheduling."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineRequest:
    """A request as submitted to the engine core (already tokenised and validated)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens already delivered to the caller, when a request is resumed after a failure:
    the engine re-prefills prompt + these and continues at the next output index."""
    cache_salt: str = ""
    """Prefix-cache salt: requests share cached KV blocks only when their salts are equal
    (the gateway sets one per tenant to keep tenants from probing each other's prompts)."""
    tenant: str = "default"
    """Who asked: fair scheduling shares the engine between tenants."""
    priority: int = 0
    """Tier: lower is admitted first and preempted last."""
    weight: float = 1.0
    """The tenant's weight in fair scheduling (twice the weight, twice the share)."""
    prompt_group: str = ""
    """Shared by the n choices of one API request (same prompt): the core prefills the prompt
    once and the others take its blocks from the prefix cache ('' for none)."""
    submitted_at: float = field(default_factory=time.monotonic)
    """Monotonic time it was made (in the gateway: one clock for every process on the
    machine), its arrival for the scheduler: a request that came in while a step ran arrived
    before that step's tokens went out."""
    num_failures: int = 0
    """Replica failures in a row (engine core deaths) this request was in flight at, with no
    token between them, before this submission (see EngineConfig.max_request_failures)."""


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
