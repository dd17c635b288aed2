"""What the gateway (AsyncEngine) and its engine core (core_process) say to each other over
their pipe: one dataclass per message, read with `match` on its class.

gateway -> core: Add | Abort | ArmSpare | StateQuery | ScoreQuery | AdoptPool | Shutdown |
                 Batch
core -> gateway: Ready or StartFailed first, then Deltas | StateReply | ScoreReply |
                 PoolAdopted | StatusChanged | CoreDead

A query carries a token of the gateway's choosing; its reply carries the same token. Either
side raises ProtocolError on a message of any other type.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from tokstream.errors import ErrorKind, ReplicaError
from tokstream.state_snapshot import ReplicaStatus

if TYPE_CHECKING:  # annotations only: at run time, a cycle through __init__ (it imports all)
    from tokstream.engine.messages.request import EngineRequest, RequestDelta
    from tokstream.engine.messages.start_times import StartTimes
    from tokstream.engine.messages.worker import ScoreResult


class ProtocolError(ReplicaError):
    """A message of a type this end does not know: the two ends disagree on the protocol (a
    bug, or two versions), so the replica cannot be trusted."""

    def __init__(self, reader: str, message: object):
        super().__init__(f"the {reader} got a message it does not know: "
                         f"{type(message).__name__} {message!r:.200}")
        self.message = message


# --- gateway -> core ----------------------------------------------------------------------

@dataclass
class Add:
    """Submit a request; its deltas come back in Deltas messages."""

    request: EngineRequest


@dataclass
class Abort:
    """Stop a request; its final delta (finish_reason 'abort') still comes back."""

    request_id: str


@dataclass
class ArmSpare:
    """Keep a standby rank group from now on (a spare core that has taken over)."""


@dataclass
class StateQuery:
    """Ask for the core's snapshot; a StateReply answers between two steps."""

    token: int


@dataclass
class ScoreQuery:
    """Ask for one teacher-forced pass (EngineCore.score); a ScoreReply answers between two
    steps."""

    token: int
    token_ids: list[int]
    start: int
    """Score positions start..len(token_ids)-1."""


@dataclass
class AdoptPool:
    """Take over the KV pool files' block index (engine/recovery/pool_adoption.py): the gateway
    sends it once no other process maps the pool, before the first request; a PoolAdopted
    answers."""

    token: int


@dataclass
class Shutdown:
    """Stop: the core stops its ranks and exits."""


@dataclass
class Batch:
    """Messages the core reads together before its next step (AsyncEngine.batch: a new
    core's resumed requests then share one re-prefill step)."""

    messages: list[GatewayMessage]
    """Any gateway message but a Batch."""


GatewayMessage = (Add | Abort | ArmSpare | StateQuery | ScoreQuery | AdoptPool | Shutdown
                  | Batch)


# --- core -> gateway ----------------------------------------------------------------------

@dataclass
class Ready:
    """The core has loaded and serves from now on: the facts the gateway sizes itself to."""

    start_times: StartTimes
    model: str
    dtype: str
    """The serving dtype of the weights and activations."""
    weights: str
    """'native' (GGUF blocks) or 'dequantized' (weights in dtype)."""
    pid: int
    """The core's own process."""
    worker_pids: list[int]
    """Its rank group's processes, rank order."""
    num_blocks: int
    """KV pool blocks (a replacement core is given the same number)."""
    block_size: int
    """Tokens per KV block."""
    max_model_len: int
    vocab_size: int
    capacity: str
    """EngineCore.capacity_summary(): the pool arithmetic, one line."""

    def info(self) -> dict[str, Any]:
        """The fields by name (AsyncEngine.info, what the gateway's readers index)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class StartFailed:
    """The core could not start (sent instead of Ready); it exits."""

    error_kind: ErrorKind
    """USER: the configuration or the model is wrong (UserInputError); REPLICA otherwise."""
    message: str


@dataclass
class Deltas:
    """What the requests gained in one step (or on an add, abort or failure between steps)."""

    deltas: list[RequestDelta]


@dataclass
class StateReply:
    token: int
    """The StateQuery's."""
    snapshot: dict[str, Any]
    """EngineCore.snapshot(): scheduler, block map, requests, events, pids."""


@dataclass
class ScoreReply:
    token: int
    """The ScoreQuery's."""
    result: ScoreResult | None
    """None when the pass failed."""
    error_kind: ErrorKind | None = None
    """Why it failed: USER (bad token ids), OVERLOADED (no room for the pass now) or REPLICA
    (the workers' pass failed)."""
    error: str | None = None


@dataclass
class PoolAdopted:
    token: int
    """The AdoptPool's."""
    blocks: int
    """Blocks of cached prefixes found in the index and kept (0: none, or see refused)."""
    refused: str | None = None
    """Why the core keeps no index (its ranks' pools are their own, ...); None: it keeps it."""


@dataclass
class StatusChanged:
    """The replica's status changed (CoreRecovery.recover): a rank-group restart began, ended,
    or gave up."""

    status: ReplicaStatus
    reason: str | None
    restarts: int
    """Rank-group restarts this core has done."""
    worker_pids: list[int]
    """The rank group's processes now."""
    resumed_requests: int
    """Requests put back in line by those restarts."""
    recoveries: int
    """Recoveries that ended in a ready group (a retry while down repeats the last one's
    recovery_s)."""
    recovery_s: float | None
    """The last recovery's seconds from failure to a ready group (None before the first)."""


@dataclass
class CoreDead:
    """The core is going away after a failure it could not recover from, with every live
    request's error delta sent before this; or, made by the gateway's reader, the pipe closed."""

    reason: str


CoreMessage = (Ready | StartFailed | Deltas | StateReply | ScoreReply | PoolAdopted
               | StatusChanged | CoreDead)
