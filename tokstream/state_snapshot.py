"""The /v1/state snapshot as typed dataclasses: the gateway builds it with these classes, and
`top` and `chaos` parse it with the same ones (`StateSnapshot.from_wire(json)`). The engine
core's own snapshot, which the gateway joins, is read with them too (`CoreSnapshot`).

No torch and nothing of the engine: `top` and `chaos` import this alone. The wire format is
the JSON these write (tokstream.wire); keys a class does not name ride in its `extra`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokstream.wire import ABSENT, Wire, WireEnum


class ReplicaStatus(WireEnum):
    """How callers see the replica (its rank group and engine core)."""

    READY = "ready"
    RECOVERING = "recovering"
    """A rank group or the engine core is being replaced; requests wait, streams resume."""
    DOWN = "down"
    """Recovery kept failing: live streams got an error, new requests are refused."""


# --- the engine core's part ---------------------------------------------------------------

@dataclass
class BlockMap(Wire):
    """The KV pool, compact: one character per block for its reference count ('0'-'9', '+'
    past 9); each running request's blocks and the cached prefix blocks as [first, count]
    runs."""

    ref_counts: str = ""
    owners: dict[str, list[list[int]]] = field(default_factory=dict)
    cached: list[list[int]] = field(default_factory=list)


@dataclass
class Kv(Wire):
    """KV cache blocks: the pool, the prefix cache, host swap space, and self-checks."""

    block_size: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0
    usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    swap_blocks: int = 0
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
    kind: str = ""
    request_id: str | None = None
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
    active_requests: int = 0
    served_tokens: int = 0


@dataclass
class LastStep(Wire):
    num_tokens: int = 0
    num_seqs: int = 0
    step_ms: float | None = None


@dataclass
class CoreRequestRow(Wire):
    """A request as the engine core sees it."""

    id: str = ""
    state: str = ""
    """The scheduler's status: waiting, running, preempted, ..."""
    phase: str | None = None
    """waiting | prefill | decode | preempted | recovering."""
    blocks: int = 0
    preemptions: int = 0
    computed_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CoreSnapshot(Wire):
    """The engine core's snapshot, as the gateway reads it (only what it uses is named)."""

    worker_pids: list[int] = field(default_factory=list)
    step_id: int = 0
    last_step: LastStep | None = None
    running: int = 0
    waiting: int = 0
    max_num_seqs: int | None = None
    token_budget: int | None = None
    num_preemptions: int = 0
    kv: Kv | None = None
    requests: list[CoreRequestRow] = field(default_factory=list)
    tenants: list[FairnessRow] | None = None
    events: list[Event] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


# --- what the gateway adds ------------------------------------------------------------------

@dataclass
class Replica(Wire):
    """The served model and the replica's health, restarts and recoveries."""

    status: ReplicaStatus = ReplicaStatus.READY
    restarts: int = 0
    restarts_by_kind: dict[str, int] = field(default_factory=dict)
    """rank: the rank group replaced by the core; core: the engine core replaced by the
    gateway."""
    resumed_requests: dict[str, int] = field(default_factory=dict)
    recovery_s: dict[str, list[float]] = field(default_factory=dict)
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    tp: int | None = None
    spare: bool = False
    max_model_len: int | None = None
    uptime_s: float = 0.0
    error: str | None = None
    """Why the engine core died, while it is dead."""


@dataclass
class Rank(Wire):
    rank: int = 0
    pid: int | None = None
    alive: bool = False
    rss_bytes: int | None = None
    cpu_percent: float | None = None
    """Of one core, since the previous snapshot (None on a process's first)."""


BATCH_FROM_CORE = ("chunked_prefill", "max_prefill_chunk", "preemption_mode",
                   "num_swap_preemptions", "policy", "prefill_tokens_total",
                   "decode_tokens_total")
"""Batch keys copied from the core's snapshot when it has them."""


@dataclass
class Batch(Wire):
    """The batch: occupancy now, the last step, and the scheduler's settings and totals."""

    running: int = 0
    waiting: int = 0
    max_num_seqs: int | None = None
    token_budget: int | None = None
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    last_step_ms: float | None = None
    step_id: int = 0
    num_preemptions: int = 0
    chunked_prefill: bool | None = ABSENT
    max_prefill_chunk: int | None = ABSENT
    preemption_mode: str | None = ABSENT
    num_swap_preemptions: int | None = ABSENT
    policy: str | None = ABSENT
    prefill_tokens_total: int = ABSENT
    decode_tokens_total: int = ABSENT


@dataclass
class AdmissionState(Wire):
    """The gateway's admission queue (admitted, no first token yet) and its bounds."""

    waiting_requests: int = 0
    waiting_tokens: int = 0
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamRow(Wire):
    """One live request as the gateway sees it: tokens delivered, latencies."""

    id: str = ""
    tenant: str | None = None
    api: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tokens_per_s: float | None = None
    age_s: float = 0.0
    pending_tokens: int = 0
    """Delivered by the engine, not yet sent to the caller."""
    cancelled: str | None = None
    resumes: int = 0
    """Times it was resubmitted to a new engine core or rank group."""


@dataclass
class RequestRow(StreamRow):
    """A /v1/state request row: the gateway's view joined with the core's."""

    state: str = ""
    """The core's state, or finishing (delivered, closing) / submitted (not in the core)."""
    blocks: int = 0
    preemptions: int = 0
    computed_tokens: int | None = None
    phase: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestParams(Wire):
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None


@dataclass
class RequestDetail(StreamRow):
    """GET /v1/state/requests/{id}: one live request with its recent text."""

    engine: CoreRequestRow | None = None
    """The core's row (None while it is not in the core)."""
    state: str = ""
    params: RequestParams = field(default_factory=RequestParams)
    delivered_token_ids: list[int] = field(default_factory=list)
    """The last 64."""
    recent_text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TenantRow(Wire):
    """A tenant of the tenants file: its limits and what it used."""

    name: str = ""
    weight: float | None = None
    priority: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    live: int = 0
    tokens_available: int | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    refusals: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProcessInfo(Wire):
    pid: int | None = None
    alive: bool = ABSENT


@dataclass
class HostMemory(Wire):
    total_bytes: int = 0
    available_bytes: int = 0
    cpu_count: int | None = None


@dataclass
class ProcessRow(Wire):
    role: str = ""
    """gateway, engine, or rankN."""
    pid: int | None = None
    rss_bytes: int | None = None
    cpu_percent: float | None = None


@dataclass
class DeviceMemory(Wire):
    index: int = 0
    total_bytes: int | None = None
    used_bytes: int | None = None
    utilization_percent: float | None = None


@dataclass
class Memory(Wire):
    host: HostMemory = field(default_factory=HostMemory)
    processes: list[ProcessRow] = field(default_factory=list)
    devices: list[DeviceMemory] = field(default_factory=list)


@dataclass
class Timing(Wire):
    """What this snapshot cost: waiting for the core, and the gateway's own part."""

    core_wait_ms: float = 0.0
    gateway_build_ms: float = 0.0


@dataclass
class StateSnapshot(Wire):
    """GET /v1/state."""

    replica: Replica = field(default_factory=Replica)
    ranks: list[Rank] = field(default_factory=list)
    kv: Kv = field(default_factory=Kv)
    batch: Batch = field(default_factory=Batch)
    admission: AdmissionState = field(default_factory=AdmissionState)
    requests: list[RequestRow] = field(default_factory=list)
    tenants: list[TenantRow] = field(default_factory=list)
    fairness: list[FairnessRow] | None = None
    """The engine's fair-queue counters per tenant (None before the core's first answer)."""
    events: list[Event] = field(default_factory=list)
    engine: ProcessInfo = field(default_factory=ProcessInfo)
    gateway: ProcessInfo = field(default_factory=ProcessInfo)
    memory: Memory = field(default_factory=Memory)
    timing: Timing = field(default_factory=Timing)
    build_ms: float = ABSENT
    """The whole snapshot's time in the route."""

    @property
    def recovering(self) -> bool:
        """The replica is being replaced or is down: its requests are not progressing."""
        return self.replica.status in (ReplicaStatus.RECOVERING, ReplicaStatus.DOWN)

    def rows_by_id(self) -> dict[str, RequestRow]:
        return {row.id: row for row in self.requests}

