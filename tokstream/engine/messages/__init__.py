"""Every type that crosses a process boundary, plain data, no torch.

- request: a request as submitted to the engine core (EngineRequest) and answered step by
  step (RequestDelta, FinishReason).
- gateway: the gateway <-> engine core protocol, one dataclass per message.
- worker: the engine core <-> rank group protocol (StepPlan, StepResult, scoring).
- start_times: where an engine core's start goes (in its Ready message).
- rank: what each rank says once it has loaded (WorkerReady) or failed to (WorkerFailed).
"""

from tokstream.engine.messages.gateway import (Abort, Add, AdoptPool, ArmSpare, Batch,
                                               CoreDead, CoreMessage, Deltas, GatewayMessage,
                                               PoolAdopted, ProtocolError, Ready, ScoreQuery,
                                               ScoreReply, Shutdown, StartFailed, StateQuery,
                                               StateReply, StatusChanged)
from tokstream.engine.messages.request import (EngineRequest, FinishReason, RequestDelta,
                                               poison_message, token_digest)
from tokstream.engine.messages.rank import WorkerFailed, WorkerReady
from tokstream.engine.messages.start_times import StartTimes
from tokstream.engine.messages.worker import (NewRequestData, PromptLogprobs, ScheduledChunk,
                                              ScoreRequest, ScoreResult, StepPlan, StepResult,
                                              TokenLogprobs)

__all__ = [
    "Abort", "Add", "AdoptPool", "ArmSpare", "Batch", "CoreDead", "CoreMessage", "Deltas",
    "EngineRequest", "FinishReason", "GatewayMessage", "NewRequestData", "PoolAdopted",
    "PromptLogprobs", "ProtocolError", "Ready", "RequestDelta", "ScheduledChunk", "ScoreQuery",
    "ScoreReply",
    "ScoreRequest", "ScoreResult", "Shutdown", "StartFailed", "StartTimes", "StateQuery",
    "StateReply", "StatusChanged", "StepPlan", "StepResult", "TokenLogprobs", "WorkerFailed",
    "WorkerReady", "poison_message", "token_digest",
]
