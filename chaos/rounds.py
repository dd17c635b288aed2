"""One round of an experiment: send the recorded workload, inject the fault at its moment, let
the system recover, drain, and check the history, the leaks and the content."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

import psutil

from tokstream.chaos import faults, lifecycle_faults
from tokstream.chaos.api import ServerAPI
from tokstream.chaos.audit import audit
from tokstream.chaos.experiments import (SIGNALS, Experiment, ServerFacts, long_prompt_stream,
                                         trigger_point, workload)
from tokstream.chaos.faults import ENGINE_FAULTS, STOPPING
from tokstream.chaos.history import Violations, check_history
from tokstream.chaos.target import Target
from tokstream.chaos.timeline import around_fault
from tokstream.chaos.workload import Recorder, StreamHistory, StreamSpec
from tokstream.process_end import running
from tokstream.state_snapshot import ReplicaStatus, StateSnapshot

SAMPLE_INTERVAL_S = 0.25
DRAIN_TIMEOUT_S = 180.0
SLOW_PHASE_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = 30.0


@dataclass
class Context:
    """What every round of one experiment shares."""

    exp: Experiment
    target: Target
    api: ServerAPI
    facts: ServerFacts
    clock: float
    num_streams: int
    max_tokens: int
    seed: int
    rank: int | None
    timeout_s: float
    baseline_used_blocks: int = 0
    self_check_failures: int = 0
    """The engine's count of failed block self-checks before this round."""
    reference: dict[str, list[int]] = field(default_factory=dict)
    """Token ids of the fault-free run, by stream name (greedy and seeded streams)."""

    def say(self, message: str) -> None:
        """Progress on stderr (a soak runs for a long time)."""
        print(f"chaos {time.monotonic() - self.clock:7.1f}s  {message}", file=sys.stderr,
              flush=True)


class Sampler:
    """Polls /v1/state during a round: per request, the most preemptions and resumes seen,
    and whether the gateway cancelled it; and the engine's preemption count."""

    def __init__(self, api: ServerAPI):
        self.api = api
        self.requests: dict[str, dict] = {}
        self.preemptions: list[int] = []
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            try:
                self.take(await self.api.state())
            except Exception:  # noqa: BLE001 - a poll during a restart may fail; the next one won't
                pass
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def take(self, state: StateSnapshot) -> None:
        self.preemptions.append(state.batch.num_preemptions)
        for row in state.requests:
            seen = self.requests.setdefault(row.id, {"preemptions": 0, "resumes": 0,
                                                     "cancelled": None,
                                                     "prompt_tokens": row.prompt_tokens})
            seen["preemptions"] = max(seen["preemptions"], row.preemptions)
            seen["resumes"] = max(seen["resumes"], row.resumes)
            seen["cancelled"] = row.cancelled or seen["cancelled"]


async def run_round(ctx: Context, index: int) -> dict:
    violations = Violations()
    rng = random.Random(f"{ctx.seed}/{index}")
    specs = workload(ctx.exp, ctx.facts, ctx.num_streams, ctx.max_tokens, ctx.seed, index)
    recorder = Recorder(ctx.target.url, ctx.target.headers(), ctx.clock, ctx.timeout_s)
    sampler = Sampler(ctx.api)
    before = await ctx.api.state()
    sampler.take(before)
    sampler.start()
    fault: dict = {"round": index, "kind": ctx.exp.fault or ctx.exp.name}
    stopped: psutil.Process | None = None
    try:
        if ctx.exp.name in lifecycle_faults.EXPERIMENTS:
            stopped = await lifecycle_faults.run(ctx, recorder, specs, rng, fault, violations)
        else:
            for spec in specs:
                recorder.start(spec)
        if ctx.exp.fault is not None:
            stopped = await _signal_fault(ctx, recorder, rng, index, fault, violations)
        elif ctx.exp.name == "slow-client":
            await _slow_phase(ctx, recorder, sampler, violations)
        ctx.say(f"round {index}: {ctx.exp.fault or ctx.exp.name} - waiting for the streams "
                "to end")
        await _finish(recorder, ctx.timeout_s)
    finally:
        recorder.released.set()
        if stopped is not None:
            fault["stopped_process_after_round"] = faults.release_stopped(stopped)
        await _finish(recorder, 10)
        await recorder.close()
        await sampler.stop()
    if ctx.exp.name == "drain":  # the server is gone: its streams are the whole story
        rows = check_history(recorder.histories, violations)
        await lifecycle_faults.after_drain(fault, violations)
        lifecycle_faults.check_outcome(ctx, fault, rows, violations)
        return {"round": index, "fault": fault, "streams": rows, "content": [],
                "drain": {}, "violations": violations}
    ctx.say(f"round {index}: draining")
    drained = await _drain(ctx, violations)
    rows = check_history(recorder.histories, violations)
    for row in rows:
        row.update(sampler.requests.get(row["request_id"] or "", {}))
    interrupted = _interrupted(ctx, fault, rows, recorder.histories, sampler, violations)
    await _leaked_processes(fault, violations)
    messages = {h.spec.name: h.spec.body.get("messages") for h in recorder.histories}
    content = await audit(ctx.api, rows, messages, ctx.reference, interrupted, violations)
    fault["server_recovery_s"] = _new_recoveries(before, drained)
    fault["engine_events"] = [
        {k: v for k, v in e.to_wire().items()
         if k in ("time", "kind", "reason", "resumed", "source", "kv", "kv_blocks_kept")}
        for e in drained.events if e.time >= fault.get("wall_time", time.time())
        and e.kind in ("rank_failure", "restarted", "restart_failed", "engine_dead",
                          "engine_restarted", "engine_restart_failed", "request_failed")]
    if ctx.exp.fault == "hang-engine" and not any(
            e["kind"] == "engine_dead" and "hung" in (e.get("reason") or "")
            for e in fault["engine_events"]):
        violations.add("fault_not_injected", "the stopped engine core was never found hung: "
                       f"{[e['kind'] for e in fault['engine_events']]}")
    if ctx.exp.name in lifecycle_faults.EXPERIMENTS:
        lifecycle_faults.check_outcome(ctx, fault, rows, violations)
        lifecycle_faults.check_events(ctx, fault, fault["engine_events"], violations)
    return {"round": index, "fault": fault, "streams": rows, "content": content,
            "drain": {"kv": {k: v for k, v in drained.kv.to_wire().items() if k != "block_map"},
                      "batch": drained.batch.to_wire(), "requests": len(drained.requests),
                      "status": drained.replica.status},
            "violations": violations}


async def _signal_fault(ctx: Context, recorder: Recorder, rng: random.Random,
                        index: int, fault: dict,
                        violations: Violations) -> psutil.Process | None:
    j, k = trigger_point(rng, ctx.num_streams, ctx.max_tokens)
    def long_prompt(attempt: int) -> StreamSpec:
        return long_prompt_stream(ctx.facts, index, ctx.seed, ctx.max_tokens, attempt)

    state, why = await faults.await_trigger(ctx.api, recorder, ctx.exp.fault, j, k, long_prompt)
    fault["trigger"] = why
    ctx.say(f"trigger: {why}")
    if state is None:
        violations.add("fault_not_injected", why)
        return None
    what, pid = faults.victim(state, ctx.exp.fault, ctx.rank, ctx.target.url)
    group = _group(state, ctx.exp.fault)
    # Times taken before the signal: on a busy machine the server may log its reaction before
    # this process runs again.
    at_s, wall_time = recorder.now(), time.time()
    process = faults.inject(ctx.exp.fault, pid)
    ctx.say(f"{SIGNALS[ctx.exp.fault]} {what} (pid {pid})")
    fault.update({"signal": SIGNALS[ctx.exp.fault], "target": what, "pid": pid,
                  "at_s": at_s, "wall_time": wall_time,
                  "state_at_fault": state.rows_by_id(),
                  "old_processes": group})
    return process if ctx.exp.fault in STOPPING else None


def _group(state: StateSnapshot, fault: str) -> list[psutil.Process]:
    """The processes the fault's recovery must replace: the rank group, or the engine core
    with everything under it."""
    pids = [state.engine.pid] if fault in ENGINE_FAULTS else [r.pid for r in state.ranks]
    group = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            group.append(process)
            if fault in ENGINE_FAULTS:
                group += process.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return group


async def _slow_phase(ctx: Context, recorder: Recorder, sampler: Sampler,
                      violations: Violations) -> None:
    """While the slow clients read nothing, every other stream must finish; then, once the
    server has cancelled (or finished) each slow one, they read again."""
    histories = recorder.histories
    fast = [h for h in histories if h.spec.stop_reading_after is None]
    slow = [h for h in histories if h.spec.stop_reading_after is not None]
    deadline = time.monotonic() + SLOW_PHASE_TIMEOUT_S
    while any(h.ended_at is None for h in fast) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if any(h.ended_at is None for h in fast):
        violations.add("stalled", f"{sum(h.ended_at is None for h in fast)} streams did not "
                                  f"finish while {len(slow)} clients were not reading")

    def settled(state: StateSnapshot) -> bool:
        rows = state.rows_by_id()
        return all(h.request_id not in rows or rows[h.request_id].cancelled
                   or rows[h.request_id].state == "finishing" for h in slow)

    await ctx.api.state_until(settled, SLOW_PHASE_TIMEOUT_S, interval_s=0.2)
    recorder.released.set()


async def _finish(recorder: Recorder, timeout_s: float) -> None:
    """Wait for every stream to end; cancel what has not after timeout_s (they count as cut)."""
    pending = [t for t in recorder.tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=timeout_s)
        for task in still:
            task.cancel()
        await asyncio.gather(*still, return_exceptions=True)


async def _drain(ctx: Context, violations: Violations) -> StateSnapshot:
    """Wait until the server is idle and ready again; what is left then has leaked."""
    def idle(state: StateSnapshot) -> bool:
        return (not state.requests and state.batch.running == 0 and state.batch.waiting == 0
                and state.replica.status == ReplicaStatus.READY)

    state, ok = await ctx.api.state_until(idle, DRAIN_TIMEOUT_S, interval_s=0.2)
    leaked = state.kv.used_blocks - ctx.baseline_used_blocks
    if leaked > 0:
        violations.add("leaked_blocks", f"{leaked} KV blocks still used after the drain "
                                        f"(baseline {ctx.baseline_used_blocks})", leaked)
    engine = state.batch.running + state.batch.waiting
    gateway = len(state.requests)
    if engine or gateway:
        violations.add("leaked_requests", f"after {DRAIN_TIMEOUT_S:.0f} s: {gateway} requests "
                                          f"in the gateway, {engine} in the engine",
                       max(engine, gateway))
    if state.replica.status != ReplicaStatus.READY or await ctx.api.health() != 200:
        violations.add("not_recovered", f"replica {state.replica.status} after the drain")
    check_block_bookkeeping(ctx, state, violations)
    return state


def check_block_bookkeeping(ctx: Context, state: StateSnapshot, violations: Violations) -> None:
    """The engine's block self-check: run for this snapshot (kv.self_check), and after every
    recovery in the round (failures counted since the last round)."""
    now = state.kv.self_check
    failures = state.kv.self_check_failures - ctx.self_check_failures
    ctx.self_check_failures = state.kv.self_check_failures
    if now or failures > 0:
        found = [e.to_wire() for e in state.events if e.kind == "self_check_failed"]
        violations.add("block_bookkeeping", f"{failures} failed self-checks this round, now: "
                                            f"{now[:5]}, after: {found[-1:]}",
                       max(1, failures))


def _interrupted(ctx: Context, fault: dict, rows: list[dict], histories: list[StreamHistory],
                 sampler: Sampler, violations: Violations) -> set[str]:
    """Fill in what the fault did and return the streams it interrupted."""
    if "at_s" in fault:
        in_flight, recovery = around_fault(histories, fault["at_s"],
                                           fault.pop("state_at_fault"), violations)
        fault["in_flight"], fault["recovery_s"] = in_flight, recovery
        return {row["stream"] for row in in_flight}
    if ctx.exp.name == "disconnect-storm":
        hung = [{"stream": h.spec.name, "after_tokens": len(h.tokens), "at_s": h.ended_at}
                for h in histories if h.hung_up]
        fault["hung_up"] = hung
        if not hung:
            violations.add("fault_not_injected", "no client hung up mid-stream")
    if ctx.exp.name == "cache-exhaustion":
        preempted = {r["name"] for r in rows if r.get("preemptions")}
        fault.update({"num_blocks": ctx.facts.num_blocks, "block_size": ctx.facts.block_size,
                      "demand_tokens": sum(r["max_tokens"] + (r.get("prompt_tokens") or 0)
                                           for r in rows),
                      "preemptions": (max(sampler.preemptions) - min(sampler.preemptions)
                                      if sampler.preemptions else 0),
                      "preempted_streams": sorted(preempted)})
        if not fault["preemptions"]:
            violations.add("fault_not_injected", "the KV pool never ran out: no preemption")
        return preempted
    if ctx.exp.name == "slow-client":
        _check_fast_pace(histories, rows, violations)
        stopped = [h for h in histories if h.stopped_reading]
        fault["slow_clients"] = [{"stream": h.spec.name, "stopped_after": h.spec.stop_reading_after,
                                  "not_reading_s": h.stopped_reading[1] - h.stopped_reading[0],
                                  "cancelled": (sampler.requests.get(h.request_id or "") or {})
                                  .get("cancelled")} for h in stopped]
        if not stopped:
            violations.add("fault_not_injected", "no client stopped reading")
    return set()


def _check_fast_pace(histories: list[StreamHistory], rows: list[dict],
                     violations: Violations) -> None:
    """A reading stream that was never preempted gets a token on every engine step once it
    decodes (several on a step that accepts drafts): a gap in its step ids means the batch
    waited (for a slow client)."""
    preempted = {r["name"] for r in rows if r.get("preemptions")}
    for history in histories:
        if history.spec.stop_reading_after is not None or history.spec.name in preempted:
            continue
        if steps_skipped([s for _, _, _, s in history.tokens if s is not None][1:]):
            violations.add("stalled", f"{history.spec.name}: engine steps skipped while it "
                                      "was decoding")


def steps_skipped(step_ids: list[int]) -> bool:
    """Whether a stream that should get a token on every engine step missed one: its step ids
    (several alike on a step that accepted drafts) must run on without a gap."""
    steps = [s for i, s in enumerate(step_ids) if i == 0 or s != step_ids[i - 1]]
    return bool(steps) and steps != list(range(steps[0], steps[0] + len(steps)))


async def _leaked_processes(fault: dict, violations: Violations) -> None:
    """The replaced group's processes must be gone (a zombie awaiting its reaper counts)."""
    group = fault.pop("old_processes", [])
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        left = [process.pid for process in group if running(process)]
        if not left or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    if left:
        violations.add("leaked_processes", f"pids {left} of the replaced group still run",
                       len(left))


def _new_recoveries(before: StateSnapshot, after: StateSnapshot) -> dict[str, list[float]]:
    """The server's own recovery times (per kind) recorded during the round."""
    old = before.replica.recovery_s
    new = after.replica.recovery_s
    return {kind: values[len(old.get(kind, [])):] for kind, values in new.items()
            if len(values) > len(old.get(kind, []))}
