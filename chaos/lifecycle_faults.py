"""Faults in a server's life rather than in one process: a shutdown mid-stream (drain), a
request that breaks the replica at every step (poison-request), an engine core that hangs
while starting (hang-on-start), and a rank killed while a waiting request holds cached prefix
blocks behind long unchunked prompts (stale-prefix). Each sends its round's streams itself,
because the fault is in how they are sent or in what happens around them."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import psutil

from tokstream.chaos import faults
from tokstream.chaos.history import Violations
from tokstream.chaos.workload import Recorder, StreamSpec
from tokstream.process_end import wait_ended
from tokstream.state_snapshot import StateSnapshot

POISON_TOKEN = 7
"""The token whose prefill kills rank 0 on the poison-request server (TOKSTREAM_POISON); the
poison prompt starts with it, no chat-templated prompt does."""
START_TIMEOUTS_PER_STEP = 3
"""--start-timeout of the hang-on-start server, in step deadlines (--step-timeout, default 10 s:
30 s; a core starts in seconds here)."""
NEW_CORE_TIMEOUT_S = 60.0
DRAIN_EXIT_TIMEOUT_S = 60.0
EXPERIMENTS = ("drain", "poison-request", "hang-on-start", "stale-prefix", "rapid-core-deaths")
RAPID_DEATHS = 3
"""rapid-core-deaths: engine cores SIGKILLed in a row (below the replica's limit of 5)."""


async def run(ctx, recorder: Recorder, specs: list[StreamSpec], rng: random.Random,
              fault: dict, violations: Violations) -> psutil.Process | None:
    """Send the round's streams and inject its fault; returns a stopped process to release."""
    name = ctx.exp.name
    if name == "stale-prefix":
        await _stale_prefix(ctx, recorder, specs, fault, violations)
        return None
    for spec in specs:
        if spec.role != "poison":
            recorder.start(spec)
    if name == "rapid-core-deaths":
        await _rapid_core_deaths(ctx, recorder, fault, violations)
        return None
    j = rng.randrange(len([s for s in specs if s.role == "decode"]))
    k = rng.randint(2, max(2, ctx.max_tokens // 3))
    if not await recorder.until(j, k, faults.TRIGGER_TIMEOUT_S):
        violations.add("fault_not_injected", f"stream s{j} ended before {k} tokens")
        return None
    fault["trigger"] = f"stream s{j} had received {k} tokens"
    if name == "drain":
        fault["at_s"] = recorder.now()
        await _drain(ctx, fault, violations)
    elif name == "poison-request":
        state = await ctx.api.state()
        _mark(ctx, recorder, fault, state)
        fault["pid"] = state["ranks"][0]["pid"]
        recorder.start(next(s for s in specs if s.role == "poison"))
        fault.update({"signal": f"a prompt starting with token {POISON_TOKEN}",
                      "target": "rank 0, at each step that prefills it"})
    elif name == "hang-on-start":
        return await _hang_on_start(ctx, recorder, fault, violations)
    return None


def _mark(ctx, recorder: Recorder, fault: dict, state: StateSnapshot) -> None:
    """The fault's moment, for the timeline (who was in flight, when each resumed)."""
    fault.update({"at_s": recorder.now(), "wall_time": time.time(),
                  "state_at_fault": state.rows_by_id()})
    _check_now(state, "at the fault", violations=fault.setdefault("_violations", []))


def _check_now(state: StateSnapshot, when: str, violations: list) -> None:
    problems = state.kv.self_check
    if problems:
        violations.append(f"{when}: {problems[:5]}")


async def _drain(ctx, fault: dict, violations: Violations) -> None:
    """SIGTERM the gateway: readiness goes 503 and a new request is refused with retry-after
    while every open stream still runs to its end; then the server exits by itself."""
    state = await ctx.api.state()
    _check_now(state, "at the SIGTERM", fault.setdefault("_violations", []))
    gateway = psutil.Process(state.gateway.pid)
    tree = [gateway, *gateway.children(recursive=True)]
    fault.update({"signal": "SIGTERM", "target": "gateway", "pid": gateway.pid,
                  "events_before": len(state.events)})
    gateway.send_signal(signal.SIGTERM)
    async with httpx.AsyncClient(base_url=ctx.target.url, timeout=10) as client:
        ready = await _poll(lambda: client.get("/health/ready"),
                            lambda r: r.status_code == 503, 10)
        live = (await client.get("/health/live")).status_code
        refused = await client.post("/v1/messages", headers=ctx.target.headers(), json={
            "model": ctx.facts.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "late"}]})
    fault["during_drain"] = {"ready": ready.status_code if ready else None, "live": live,
                             "new_request": refused.status_code,
                             "retry_after": refused.headers.get("retry-after")}
    if ready is None or live != 200 or refused.status_code not in (503, 529) \
            or not refused.headers.get("retry-after"):
        violations.add("drain_broken", f"while draining: {fault['during_drain']}")
    fault["tree"] = tree


async def _poll(get, ok, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = await get()
            if ok(response):
                return response
        except httpx.HTTPError:
            return None
        await asyncio.sleep(0.02)
    return None


async def after_drain(fault: dict, violations: Violations) -> None:
    """The drained server must exit on its own, with everything under it."""
    tree = fault.pop("tree", [])
    alive = await asyncio.to_thread(wait_ended, tree, DRAIN_EXIT_TIMEOUT_S)
    fault["exited"] = not alive
    if alive:
        violations.add("drain_broken", f"pids {[p.pid for p in alive]} still run "
                                       f"{DRAIN_EXIT_TIMEOUT_S:.0f} s after the streams ended")


async def _hang_on_start(ctx, recorder: Recorder, fault: dict,
                         violations: Violations) -> psutil.Process | None:
    """SIGKILL the engine core, then SIGSTOP the core the gateway starts in its place: the
    start deadline must kill that one and a third must take over."""
    state = await ctx.api.state()
    _mark(ctx, recorder, fault, state)
    what, pid = faults.victim(state, "kill-engine", None, ctx.target.url)
    gateway = psutil.Process(state.gateway.pid)
    old = {p.pid for p in gateway.children()}
    faults.inject("kill-engine", pid)
    fault.update({"signal": "SIGKILL, then SIGSTOP", "target": what, "pid": pid,
                  "old_processes": [psutil.Process(pid)]})
    deadline = time.monotonic() + NEW_CORE_TIMEOUT_S
    while time.monotonic() < deadline:
        new = [p for p in gateway.children() if p.pid not in old and _is_core(p)]
        if new:
            new[0].suspend()
            fault["stopped_pid"] = new[0].pid
            return new[0]
        await asyncio.sleep(0.005)
    violations.add("fault_not_injected", "no new engine core appeared to stop")
    return None


async def _rapid_core_deaths(ctx, recorder: Recorder, fault: dict,
                             violations: Violations) -> None:
    """SIGKILL the engine core once every stream decodes, then each core that replaces it as
    soon as it has served a token, RAPID_DEATHS times in all: no request caused these deaths,
    so none may be ended for them. Both moments are taken from the server's counts as well
    as the streams': a busy client reads its streams late, and a kill timed by them alone
    came after the streams had ended."""
    streams = len(recorder.histories)
    state = await _poll_state(ctx, lambda s: len(s.requests) == streams
                              and all(r.output_tokens >= 2 for r in s.requests))
    if state is None:
        violations.add("fault_not_injected", f"the {streams} streams never all decoded")
        return
    fault["trigger"] = "every stream had at least 2 tokens (the server's count)"
    _mark(ctx, recorder, fault, state)
    fault.update({"signal": f"SIGKILL x{RAPID_DEATHS}", "target": "engine core", "pids": [],
                  "old_processes": []})
    for death in range(RAPID_DEATHS):
        if death:
            state = await _poll_state(ctx, lambda s: s.engine.pid not in fault["pids"]
                                      and s.engine.alive and s.replica.status == "ready")
            if state is None or not await _until_served(ctx, recorder, state):
                violations.add("fault_not_injected", f"death {death + 1}: no new core served "
                               f"within {NEW_CORE_TIMEOUT_S:.0f} s")
                return
        what, pid = faults.victim(state, "kill-engine", None, ctx.target.url)
        core = psutil.Process(pid)
        fault["old_processes"] += [core, *core.children(recursive=True)]
        faults.inject("kill-engine", pid)
        fault["pids"].append(pid)
        fault.setdefault("pid", pid)  # the report names the first; set before any return
        ctx.say(f"SIGKILL {what} (pid {pid}), death {death + 1} of {RAPID_DEATHS}")


async def _until_served(ctx, recorder: Recorder, ready: StateSnapshot) -> bool:
    """The core of the ready snapshot has served a token, within NEW_CORE_TIMEOUT_S: a
    stream past the count the server had delivered at ready (a token the dead core sent
    last, read late, is not taken for one), seen on the streams themselves (sooner than a
    state poll) or in the server's counts (sooner when the client lags), whichever first."""
    before = {row.id: row.output_tokens for row in ready.requests}

    def received() -> bool:
        return any(len(h.tokens) > before[h.request_id] for h in recorder.histories
                   if h.request_id in before)

    def counted(state: StateSnapshot) -> bool:
        rows = state.rows_by_id()
        return any(rid not in rows or rows[rid].output_tokens > n for rid, n in before.items())

    poll = asyncio.ensure_future(_poll_state(ctx, counted))
    try:
        while not poll.done() and not received():
            await asyncio.sleep(0.001)
        return received() or poll.result() is not None
    finally:
        poll.cancel()


async def _poll_state(ctx, predicate) -> StateSnapshot | None:
    """The first /v1/state snapshot that satisfies predicate within NEW_CORE_TIMEOUT_S (a
    poll that fails while a core is replaced is tried again); None if none did."""
    deadline = time.monotonic() + NEW_CORE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            state = await ctx.api.state()
        except Exception:  # noqa: BLE001 - mid-restart; the next poll answers
            state = None
        if state is not None and predicate(state):
            return state
        await asyncio.sleep(0.01)
    return None


def _is_core(process: psutil.Process) -> bool:
    """Not the resource tracker multiprocessing starts beside a spawned child."""
    try:
        return "resource_tracker" not in " ".join(process.cmdline())
    except psutil.Error:
        return False


async def _stale_prefix(ctx, recorder: Recorder, specs: list[StreamSpec], fault: dict,
                        violations: Violations) -> None:
    """P runs alone (its blocks stay cached); then long unchunked prompts and C (P's prompt
    and more) together: each long prompt takes a whole step's budget while C waits with P's
    blocks matched. Rank 0 is killed then: C must not read the old group's blocks."""
    first, *rest = specs
    await recorder.start(first)
    for spec in rest:
        recorder.start(spec)
    sharer = next(h for h in recorder.histories if h.spec.role == "prefix-sharer")
    longs = [h for h in recorder.histories if h.spec.role == "long-prompt"]

    def waiting_behind_long(state: StateSnapshot) -> bool:
        rows = state.rows_by_id()
        row = rows.get(sharer.request_id or "")
        return (row is not None and row.state in ("waiting", "preempted")
                and any(h.request_id in rows and rows[h.request_id].state in ("running", "waiting")
                        for h in longs))

    state, hit = await ctx.api.state_until(
        lambda s: waiting_behind_long(s) or sharer.ended_at is not None,
        faults.TRIGGER_TIMEOUT_S, interval_s=0.005)
    fault["trigger"] = ("the prefix sharer waited behind a long prompt" if hit and
                        waiting_behind_long(state) else "the prefix sharer was already "
                        "running (the kill still lands mid-batch)")
    _mark(ctx, recorder, fault, state)
    what, pid = faults.victim(state, "kill-rank", 0, ctx.target.url)
    fault["old_processes"] = [psutil.Process(r.pid) for r in state.ranks]
    faults.inject("kill-rank", pid)
    fault.update({"signal": "SIGKILL", "target": what, "pid": pid})


def check_outcome(ctx, fault: dict, rows: list[dict], violations: Violations) -> None:
    """What each experiment promises about its streams' classes."""
    for problem in fault.pop("_violations", []):
        violations.add("block_bookkeeping", problem)
    name = ctx.exp.name
    poison = [r for r in rows if r["role"] == "poison"]
    for row in rows:
        if row["role"] != "poison" and row["class"] != "complete":
            violations.add("wrongly_failed", f"{row['name']}: {row['class']} "
                                             f"({row.get('error')})")
    if name == "poison-request":
        row = poison[0] if poison else None
        if row is None or row["class"] != "failed" or \
                (row.get("error") or {}).get("type") != "api_error":
            violations.add("fault_not_injected", f"the poison request was not ended with an "
                                                 f"api_error: {row and row['class']}")
        fault["poison"] = row and {"class": row["class"], "error": row.get("error")}


def check_events(ctx, fault: dict, events: list[dict], violations: Violations) -> None:
    """The server's own account of the fault."""
    kinds = [e["kind"] for e in events]
    if ctx.exp.name == "hang-on-start" and not any(
            e["kind"] == "engine_restart_failed" and "hung while starting" in (e.get("reason")
                                                                             or "")
            for e in events):
        violations.add("fault_not_injected", f"no start was seen to hang: {kinds}")
    if ctx.exp.name == "rapid-core-deaths":
        if kinds.count("engine_dead") < RAPID_DEATHS:
            violations.add("fault_not_injected", f"fewer than {RAPID_DEATHS} core deaths: "
                                                 f"{kinds}")
        blamed = [e for e in events if e["kind"] == "request_failed"]
        if blamed:
            violations.add("wrongly_failed", f"requests ended for deaths they did not cause: "
                                             f"{blamed}")
    if ctx.exp.name == "poison-request" and kinds.count("restarted") < 1:
        violations.add("fault_not_injected", f"the poison never broke a step: {kinds}")
