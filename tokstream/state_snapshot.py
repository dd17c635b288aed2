"""The /v1/state snapshot as typed dataclasses: the gateway builds it with these classes, and
`top` and `chaos` parse it with the same ones (`StateSnapshot.from_wire(json)`). The parts the
engine core sends, which the gateway joins (the KV pool, events, the fair queue, speculation,
the core's request rows, `CoreSnapshot` itself), are in tokstream/core_state.py.

No torch and nothing of the engine: `top` and `chaos` import this alone. The wire format is
the JSON these write (tokstream.wire); keys a class does not name ride in its `extra`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokstream.core_state import CoreRequestRow, Event, FairnessRow, Kv, Speculation
from tokstream.wire import ABSENT, Wire, WireEnum


class ReplicaStatus(WireEnum):
    """How callers see the replica (its rank group and engine core)."""

    READY = "ready"
    RECOVERING = "recovering"
    """A rank group or the engine core is being replaced; requests wait, streams resume."""
    DOWN = "down"
    """Recovery kept failing: live streams got an error, new requests are refused."""


# --- what the gateway adds ------------------------------------------------------------------

@dataclass
class Replica(Wire):
    """The served model and the replica's health, restarts and recoveries."""

    status: ReplicaStatus = ReplicaStatus.READY
    restarts: int = 0
    """Rank groups and engine cores replaced since the start."""
    restarts_by_kind: dict[str, int] = field(default_factory=dict)
    """rank: the rank group replaced by the core; core: the engine core replaced by the
    gateway."""
    resumed_requests: dict[str, int] = field(default_factory=dict)
    """Per kind of restart (as restarts_by_kind), the requests resubmitted after it."""
    recovery_s: dict[str, list[float]] = field(default_factory=dict)
    """Per kind of restart, how long each took: rank, from the core detecting the failure to a ready
    group; core, from the gateway seeing the core dead to a new one holding every live request."""
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    tp: int | None = None
    spare: bool = False
    """A standby rank group is kept loaded (serve --spare)."""
    max_model_len: int | None = None
    """Most tokens of one request, prompt and output together."""
    uptime_s: float = 0.0
    """Seconds since the gateway started."""
    error: str | None = None
    """Why the engine core died, while it is dead."""


@dataclass
class Rank(Wire):
    rank: int = 0
    pid: int | None = None
    alive: bool = False
    """The process runs (it is neither gone nor a zombie)."""
    rss_bytes: int | None = None
    """Resident memory (None where it could not be read)."""
    cpu_percent: float | None = None
    """Of one core, since the previous snapshot (None on a process's first)."""


@dataclass
class LongPrefillRow(Wire):
    """A prompt in the long latency class (its prefill was long when admitted)."""

    id: str = ""
    tenant: str = ""
    prompt_tokens: int = 0
    left_tokens: int = 0
    """Tokens of it still to compute."""
    state: str = ""
    """running or waiting (the core's state)."""
    held: bool = False
    """Held back now: short prompts' prefill goes before its chunks."""


@dataclass
class PrefillPolicy(Wire):
    """The two latency classes (the engine's prefill_share.py): short prompts' prefill goes
    first, long prefills get what is left and their guaranteed share per second."""

    long_prefill_tokens: int = 0
    """A prefill with more than this many tokens left when admitted is long."""
    long_prefill_share: float = 0.0
    """The long prefills' guaranteed share of the prefill time over a second."""
    long_step_ms: float | None = None
    """The step time a long chunk is held to (None: the ITL target is off)."""
    long_share: float | None = None
    """The share of the last second's prefill time long prefills got (None: no prefill)."""
    long_first: bool = False
    """The latest step gave long chunks first: they were behind their share."""
    long_prefill_alone: bool = False
    """Long chunks run in prefill steps of their own between decode steps, a decode step and
    the prefill step after it within long_step_ms (an older core sends nothing: False)."""
    long_prefills: list[LongPrefillRow] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def held(self) -> list[LongPrefillRow]:
        return [row for row in self.long_prefills if row.held]


BATCH_FROM_CORE = ("chunked_prefill", "max_prefill_chunk", "preemption_mode",
                   "num_swap_preemptions", "policy", "prefill_tokens_total",
                   "decode_tokens_total", "prefill_policy")
"""Batch keys copied from the core's snapshot when it has them."""


@dataclass
class Batch(Wire):
    """The batch: occupancy now, the last step, and the scheduler's settings and totals."""

    running: int = 0
    """From here to num_preemptions, the core's figures (CoreSnapshot's)."""
    waiting: int = 0
    max_num_seqs: int | None = None
    token_budget: int | None = None
    last_step_tokens: int = 0
    """The latest step's tokens, sequences and duration in ms (0, 0 and None before the first
    step): the core's last_step, flattened."""
    last_step_seqs: int = 0
    last_step_ms: float | None = None
    step_id: int = 0
    num_preemptions: int = 0
    chunked_prefill: bool | None = ABSENT
    """Long prompts are prefilled in chunks. This field and the ones below are copied from the
    core's snapshot when it has them (BATCH_FROM_CORE): ABSENT, and not written, otherwise."""
    max_prefill_chunk: int | None = ABSENT
    """Most prompt tokens of one request a step (None: prompts go whole)."""
    preemption_mode: str | None = ABSENT
    num_swap_preemptions: int | None = ABSENT
    """Preemptions that swapped blocks out to the host."""
    policy: str | None = ABSENT
    prefill_tokens_total: int = ABSENT
    """Tokens computed in prefill chunks since the start."""
    decode_tokens_total: int = ABSENT
    """Tokens decoded since the start."""
    prefill_policy: PrefillPolicy | None = ABSENT
    """The two latency classes now: which long prefills are held back, their share."""


@dataclass
class AdmissionState(Wire):
    """The gateway's admission queue (admitted, no first token yet) and its bounds."""

    waiting_requests: int = 0
    """Admitted requests without a first token yet, and waiting_tokens their prompt tokens, against
    the bounds below (ServerConfig.admission)."""
    waiting_tokens: int = 0
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamRow(Wire):
    """One live request as the gateway sees it: tokens delivered, latencies."""

    id: str = ""
    """The request id (each choice of an n > 1 request has its own)."""
    tenant: str | None = None
    """None without a tenants file."""
    api: str | None = None
    """anthropic or openai: the API it came through."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    """Tokens delivered so far, of max_tokens at most."""
    max_tokens: int | None = None
    ttft_ms: float | None = None
    """From its arrival at the gateway to its first token (None until then); itl_ms, the mean gap
    between its tokens since."""
    itl_ms: float | None = None
    tokens_per_s: float | None = None
    """Output tokens a second since its first token (None before the second)."""
    age_s: float = 0.0
    pending_tokens: int = 0
    """Delivered by the engine, not yet sent to the caller."""
    cancelled: str | None = None
    """Why the gateway cancelled it (disconnected, slow_client, ...)."""
    resumes: int = 0
    """Times it was resubmitted to a new engine core or rank group."""


@dataclass
class RequestRow(StreamRow):
    """A /v1/state request row: the gateway's view joined with the core's."""

    state: str = ""
    """The core's state, or finishing (delivered, closing) / submitted (not in the core)."""
    blocks: int = 0
    """blocks, preemptions and computed_tokens are the core's row's (0, 0 and None while it is not
    in the core)."""
    preemptions: int = 0
    computed_tokens: int | None = None
    phase: str | None = None
    """waiting | prefill | decode | preempted | recovering, or the state while it is not in the
    core."""
    draft_tokens: int | None = ABSENT
    """Speculative decoding: tokens drafted for it, accepted_tokens of them accepted (the
    core's; absent with speculation off)."""
    accepted_tokens: int | None = ABSENT
    priority: int | None = None
    """Its tier in the engine, lower first (its tenant's; a Message Batch's requests run
    submit.BACKGROUND_TIER below every interactive one); None while it is not in the core."""
    background: bool = False
    """A Message Batch's request (it runs in the steps chat does not need)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestParams(Wire):
    max_tokens: int | None = None
    """The sampling settings as the engine got them: the seed is the one drawn for a request that
    sent none, plus the choice's index for a choice of n > 1."""
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
    """Its latest text (the last 2000 characters at most)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TenantRow(Wire):
    """A tenant of the tenants file: its limits and what it used."""

    name: str = ""
    weight: float | None = None
    """The tenants file's settings, from here to max_concurrent (server/access/tenants.py): its
    share of service when backlogged, its tier (lower is admitted first), its token budget and
    its live requests at most (0: no limit)."""
    priority: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    live: int = 0
    """Its requests admitted and not yet settled."""
    tokens_available: int | None = None
    """Tokens in its bucket now (None without a budget)."""
    prompt_tokens: int = 0
    """Its totals since the start: prompt tokens admitted, output tokens of its settled requests,
    and 429s for either limit."""
    output_tokens: int = 0
    refusals: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProcessInfo(Wire):
    pid: int | None = None
    alive: bool = ABSENT
    """Sent for the engine core; ABSENT, and not written, for the gateway."""


@dataclass
class HostMemory(Wire):
    total_bytes: int = 0
    available_bytes: int = 0
    """What processes can still be given without swapping (psutil's `available`: free memory plus
    what the kernel can reclaim)."""
    cpu_count: int | None = None
    """Logical CPUs."""


@dataclass
class ProcessRow(Wire):
    role: str = ""
    """gateway, engine, or rankN."""
    pid: int | None = None
    rss_bytes: int | None = None
    """Resident memory (None where it could not be read)."""
    cpu_percent: float | None = None


@dataclass
class DeviceMemory(Wire):
    index: int = 0
    """The CUDA device's index (NVML's)."""
    total_bytes: int | None = None
    used_bytes: int | None = None
    utilization_percent: float | None = None
    """Share of NVML's last sample period in which a kernel ran."""


@dataclass
class Memory(Wire):
    host: HostMemory = field(default_factory=HostMemory)
    processes: list[ProcessRow] = field(default_factory=list)
    """The gateway, the engine core and each rank."""
    devices: list[DeviceMemory] = field(default_factory=list)
    """CUDA devices (none on cpu, or without pynvml)."""


@dataclass
class Timing(Wire):
    """What this snapshot cost: waiting for the core, and the gateway's own part."""

    core_wait_ms: float = 0.0
    """Waiting for the core's snapshot (one shared by every reader)."""
    gateway_build_ms: float = 0.0


@dataclass
class StateSnapshot(Wire):
    """GET /v1/state."""

    replica: Replica = field(default_factory=Replica)
    ranks: list[Rank] = field(default_factory=list)
    """The current rank group's processes."""
    kv: Kv = field(default_factory=Kv)
    batch: Batch = field(default_factory=Batch)
    speculation: Speculation = field(default_factory=Speculation)
    """Speculative decoding: drafted and accepted tokens (acceptance)."""
    admission: AdmissionState = field(default_factory=AdmissionState)
    requests: list[RequestRow] = field(default_factory=list)
    """Every live request: the gateway's view joined with the core's."""
    tenants: list[TenantRow] = field(default_factory=list)
    """The tenants file's tenants (none without one)."""
    fairness: list[FairnessRow] | None = None
    """The engine's fair-queue counters per tenant (None before the core's first answer)."""
    events: list[Event] = field(default_factory=list)
    """The gateway's and the core's recent events, in time order."""
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

