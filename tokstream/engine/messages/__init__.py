"""Every type that crosses a process boundary, plain data, no torch.

- request: a request as submitted to the engine core (EngineRequest) and answered step by
  step (RequestDelta, FinishReason).
- gateway: the gateway <-> engine core protocol, one dataclass per message.
- worker: the engine core <-> rank group protocol (StepPlan, StepResult, scoring).
- start_times: where an engine core's start goes (in its Ready message).
- rank: what each rank says once it has loaded (WorkerReady) or failed to (WorkerFailed).

Import each type from its module: the package re-exports nothing, since a module that names a
sibling's type (gateway's Add carries request's EngineRequest) would otherwise import the
package that imports it (issue 33: no import circle, type-only ones included).
"""
