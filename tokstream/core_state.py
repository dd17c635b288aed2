"""The engine core's part of the /v1/state snapshot, as typed dataclasses: what the core sends
(the KV pool and its block map, events, the fair queue, speculative decoding's counts, its
request rows), read by the gateway as `CoreSnapshot.from_wire(...)` and joined into
tokstream/state_snapshot.py's StateSnapshot, which carries several of these classes as they are.

No torch and nothing of the engine (tokstream/engine/core_snapshot.py builds what these read):
`top` and `chaos` import this too. Keys a class does not name ride in its `extra`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokstream.wire import ABSENT, Wire


@dataclass
class BlockMap(Wire):
    """The KV pool, compact: one character per block for its reference count ('0'-'9', '+'
    past 9); each running request's blocks and the cached prefix blocks as [first, count]
    runs."""

    ref_counts: str = ""
    """Each block's reference count, one character a block, in block order."""
    owners: dict[str, list[list[int]]] = field(default_factory=dict)
    """Running request id -> its blocks, as [first, count] runs."""
    cached: list[list[int]] = field(default_factory=list)
    """The blocks holding a cached prefix (held or evictable), as runs."""


@dataclass
class Kv(Wire):
    """KV cache blocks: the pool, the prefix cache, host swap space, and self-checks."""

    block_size: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    """Blocks a request can be given now: truly free, or holding a cached prefix no request uses
    (evictable), which also count in cached_blocks."""
    used_blocks: int = 0
    cached_blocks: int = 0
    """Blocks registered in the prefix cache (held or evictable)."""
    usage: float = 0.0
    """used_blocks / num_blocks."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the start (vllm:prefix_cache_queries)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found (vllm:prefix_cache_hits)."""
    swap_blocks: int = 0
    """Host swap space in blocks, free_swap_blocks of them free (0 without swap space)."""
    free_swap_blocks: int = 0
    block_map: BlockMap = field(default_factory=BlockMap)
    self_check: list[str] = field(default_factory=list)
    """Problems the block bookkeeping has now (none when sound)."""
    self_check_failures: int = 0
    """Self-checks since the start that found any."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Event(Wire):
    """Something that happened: a preemption, rank death, restart, refusal, cancel..."""

    time: float = 0.0
    """When, in seconds since the epoch (time.time(), the gateway's and the core's alike, so their
    events merge in order)."""
    kind: str = ""
    """preempted, finished, rank_failure, restarted, refused, cancelled, ..."""
    request_id: str | None = None
    """The request it concerns (None for one about the replica)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The kind's own fields (reason, tenant, ...), and `source` "engine" for the core's."""

    @property
    def source(self) -> str:
        """engine (the core's) or gateway."""
        return self.extra.get("source") or "gateway"


@dataclass
class FairnessRow(Wire):
    """A tenant's place in the engine's fair queue."""

    tenant: str = ""
    counter: float = 0.0
    """Service received: input tokens once and output tokens twice, over the tenant's weight
    (tokstream/engine/fairness.py); the lowest backlogged tenant goes next."""
    active_requests: int = 0
    """Its requests waiting or running."""
    served_tokens: int = 0
    """Input and output tokens served since the start."""


@dataclass
class LastStep(Wire):
    num_tokens: int = 0
    """Tokens the latest step computed, over num_seqs sequences."""
    num_seqs: int = 0
    step_ms: float | None = None
    """How long the step took in ms, from scheduling it to its tokens appended."""


@dataclass
class Speculation(Wire):
    """Speculative decoding since the engine core started (issue 34; vLLM's spec_decode
    counters)."""

    method: str = "off"
    """off, ngram or auto (--speculative)."""
    num_speculative_tokens: int = 0
    """Most tokens drafted per request and step."""
    num_drafts: int = 0
    """Decodes that carried drafts (one per request and step)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    """Of the drafted tokens, those the model agreed with (each saves a step)."""
    accepted_per_position: list[int] = field(default_factory=list)
    """Drafts accepted at each draft position (0 first)."""
    acceptance_rate: float | None = None
    """num_accepted_tokens / num_draft_tokens (None before any draft)."""
    last_step_draft_tokens: int | None = ABSENT
    """Drafted positions verified in the latest step that decoded (what auto chose; absent
    from a core that predates it)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CoreRequestRow(Wire):
    """A request as the engine core sees it."""

    id: str = ""
    """The engine's request id (a choice's own, for n > 1)."""
    state: str = ""
    """The scheduler's status: waiting, running, preempted, ..."""
    phase: str | None = None
    """waiting | prefill | decode | preempted | recovering."""
    blocks: int = 0
    preemptions: int = 0
    computed_tokens: int | None = None
    """Tokens of it in the KV cache."""
    draft_tokens: int | None = ABSENT
    """Speculative decoding: tokens drafted for it, accepted_tokens of them accepted (absent
    with speculation off)."""
    accepted_tokens: int | None = ABSENT
    priority: int = 0
    """Its tier, lower first (the scheduler's order)."""
    background: bool = False
    """A Message Batch's: it runs in the steps chat does not need."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CoreSnapshot(Wire):
    """The engine core's snapshot, as the gateway reads it (only what it uses is named)."""

    worker_pids: list[int] = field(default_factory=list)
    """The rank processes, rank 0 first."""
    step_id: int = 0
    """Steps the core has run."""
    last_step: LastStep | None = None
    running: int = 0
    """Requests in the batch; waiting: those waiting to join it."""
    waiting: int = 0
    max_num_seqs: int | None = None
    """Most requests in one step, and token_budget most tokens (the scheduler's bounds)."""
    token_budget: int | None = None
    num_preemptions: int = 0
    """Preemptions since the start."""
    kv: Kv | None = None
    """The KV pool (None from a core that sends none)."""
    speculation: Speculation | None = None
    """Speculative decoding's counts (None from a core that sends none)."""
    requests: list[CoreRequestRow] = field(default_factory=list)
    tenants: list[FairnessRow] | None = None
    """The fair queue's rows, one per tenant it has seen."""
    events: list[Event] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
