"""One request's life inside the engine core: its tokens, its blocks, its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokstream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokstream.engine.messages.worker import TokenLogprobs


class RequestStatus(enum.IntEnum):
    """Ordered so that everything at or past FINISHED_STOPPED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    """The resolved seed (params.seed, or one drawn at admission)."""
    arrival: float
    """Monotonic arrival time (the gateway's, one clock for every process on the machine);
    preemption picks the latest arrival."""
    output_token_ids: list[int] = field(default_factory=list)
    """Every output token so far, including any delivered before a resume."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache."""
    block_ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None
    """The stop string or stop token that ended it, if any."""
    tenant: str = "default"
    priority: int = 0
    """Tier: lower is served first and preempted last (e.g. 0 interactive, 1 batch)."""
    background: bool = False
    """Runs only in steps no interactive request needs, beyond
    SchedulerConfig.background_rows_when_busy (EngineRequest.background)."""
    weight: float = 1.0
    """The tenant's share weight in fair scheduling."""
    cache_salt: str = ""
    """Mixed into prefix-cache hashes: requests share cached blocks only with equal salts."""
    prompt_group: str = ""
    """Requests with the same non-empty group share one prompt (the n choices of one API
    request): the scheduler prefills it for one of them and the prefix cache serves the rest."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chain hashes of this request's full, computed blocks (prefix caching)."""
    prefix_chain: list[bytes] = field(default_factory=list)
    """Chain hashes of its first full blocks, as far as a waiting request's cache lookup got
    (BlockManager.cached_prefix_tokens): its tokens there never change."""
    num_preemptions: int = 0
    num_failures: int = 0
    """Replica failures in a row this request was in flight at (reset by a step that ran)."""
    recovering: bool = False
    """Recomputing what a failure lost (resumed on a new engine core, or requeued when its
    rank group restarted), until its next token: the ITL target does not hold it back."""
    grammar_learned_at: float | None = None
    """When the ranks last learned this constrained request (a new rank group, or after a
    preemption, compiles its grammar again), on the core's monotonic clock: a grammar still
    compiling EngineConfig.grammar_compile_timeout_s later ends the request."""
    first_scheduled: float | None = None
    first_token_at: float | None = None
    """When its first output token was sampled, on the scheduler's clock (the ITL target
    protects a stream only from prompts that arrive after that)."""
    swapped_block_ids: list[int] = field(default_factory=list)
    """Host blocks holding this request's computed KV while it is swapped out (swap-mode
    preemption); block i of the cache is swapped_block_ids[i]. Empty otherwise."""

    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """The prompt tokens scored so far, by prompt index (a request that asked, until its first
    token carries them out); a position scored again after a preemption is overwritten."""

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's log-probabilities are still to be computed: it asked and has no output
        yet (a resumed request's caller got them with its first token). Such a request takes
        no prefix-cache hits, whose positions were never computed for it (as vLLM does)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_swapped(self) -> bool:
        return bool(self.swapped_block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
