"""A request as it crosses the gateway <-> engine core boundary: submitted whole
(EngineRequest), answered step by step (RequestDelta, the last one with its FinishReason).
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokstream.errors import ErrorKind
from tokstream.sampling_params import SamplingParams
from tokstream.wire import WireEnum

if TYPE_CHECKING:  # annotations only: at run time, a cycle through __init__ (it imports all)
    from tokstream.engine.messages.worker import TokenLogprobs


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
    """Who is at fault, set where the failure was caught (an error delta without one is
    taken as the replica's, see server/streaming/sse.py)."""
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
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the delta of output index 0, for a request that asked (SamplingParams.
    prompt_logprobs): one entry per prompt token, the first None (nothing precedes it)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, request_id: str, error: str, kind: ErrorKind, *, num_output_tokens: int = 0,
                num_prompt_tokens: int = 0) -> RequestDelta:
        """The last delta of a request that failed after `num_output_tokens` tokens: no new
        tokens, finish_reason ERROR, and who is at fault (`kind`)."""
        return cls(request_id, [], num_output_tokens, "", finish_reason=FinishReason.ERROR,
                   error=error, error_kind=kind, num_prompt_tokens=num_prompt_tokens,
                   num_output_tokens=num_output_tokens)


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
    background: bool = False
    """A Message Batch's: it runs in steps no interactive request needs (and at most
    SchedulerConfig.background_rows_when_busy of them beside interactive ones)."""
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
