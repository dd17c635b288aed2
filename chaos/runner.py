"""An experiment from start to verdict: find or start the server, check its steady state, run
the fault-free reference, then `--repeat` rounds (each one fault), and build the report."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict

from tokstream.errors import UserInputError

from tokstream.chaos.api import ServerAPI
from tokstream.chaos.experiments import (FILLER, PROMPT_ESTIMATE_TOKENS, ServerFacts,
                                         experiment, message, workload)
from tokstream.chaos.history import Violations, check_history
from tokstream.chaos.options import Options
from tokstream.chaos.rounds import Context, run_round
from tokstream.chaos.target import OwnServer, Target, default_tp
from tokstream.chaos.workload import Recorder, StreamSpec
from tokstream.state_snapshot import StateSnapshot

STEADY_TIMEOUT_S = 120.0
UNREACHABLE_TIMEOUT_S = 5.0


def run(options: Options) -> dict:
    """The report (a plain dict; report["ok"] is the verdict)."""
    exp = experiment(options.experiment, options.max_tokens, options.step_timeout_s)
    if exp.own_server_only and (options.url is not None or options.repeat > 1):
        raise UserInputError(f"{exp.name} needs a server of its own (no --url) and one round "
                             "(no --repeat)")
    if options.url is not None:
        target = Target(options.url, options.admin_key, options.api_key or options.admin_key,
                        own=False, description={"url": options.url})
        return asyncio.run(_main(options, target))
    tp = options.tp or default_tp(options.model)
    if options.rank is not None and options.rank >= tp:
        raise UserInputError(f"rank {options.rank}: the server has ranks 0..{tp - 1} (--tp {tp})")
    args = ["--model", options.model, "--device", options.device, "--tp", str(tp),
            "--ping-interval", "1", *(["--dtype", options.dtype] if options.dtype else []),
            *(["--spare", "--spare-core"] if options.spare else []),
            *(["--speculative", options.speculative] if options.speculative != "off" else []),
            *exp.serve_args]
    with OwnServer(args, env=exp.serve_env) as target:
        return asyncio.run(_main(options, target))


async def _main(options: Options, target: Target) -> dict:
    exp = experiment(options.experiment, options.max_tokens, options.step_timeout_s)
    clock, started = time.monotonic(), time.time()
    api = ServerAPI(target)
    violations = Violations()
    report: dict = {"experiment": exp.name, "summary": exp.summary,
                    "options": {k: v for k, v in asdict(options).items()
                                if k not in ("admin_key", "api_key")},
                    "target": {"url": target.url, "own_server": target.own,
                               **target.description},
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                    "loadavg": os.getloadavg()}
    try:
        steady = await _steady_state(api, target, clock, violations,
                                     spare=options.spare and target.own)
        report["steady_state"] = steady
        facts = await _facts(api, steady["state"])
        if options.max_tokens + PROMPT_ESTIMATE_TOKENS > facts.max_model_len:
            # Every stream would be refused (400), and the run would end as if it had failed.
            raise UserInputError(
                f"--max-tokens {options.max_tokens} and the streams' prompts (up to "
                f"{PROMPT_ESTIMATE_TOKENS} tokens) exceed the model's context of "
                f"{facts.max_model_len} tokens: pass at most "
                f"{facts.max_model_len - PROMPT_ESTIMATE_TOKENS}")
        replica = steady["state"].replica
        report["server"] = {"model": facts.model, "tp": len(steady["state"].ranks),
                            "token_budget": facts.token_budget, "num_blocks": facts.num_blocks,
                            "block_size": facts.block_size, "device": replica.device,
                            "dtype": replica.dtype, "spare": replica.spare}
        failed_checks = steady["state"].kv.self_check_failures
        del steady["state"]
        ctx = Context(exp, target, api, facts, clock, options.streams or exp.default_streams,
                      options.max_tokens, options.seed, options.rank, options.timeout_s,
                      baseline_used_blocks=steady["baseline_used_blocks"],
                      self_check_failures=failed_checks)
        ctx.say(f"steady state: health {steady['health']}, probe {steady['probe']}")
        report["reference"] = await _reference(ctx, violations)
        if ctx.exp.reference:
            ctx.say(f"fault-free reference run done ({ctx.exp.reference})")
        # The core's draft counts, to show drafts were accepted (a core that replaced a killed
        # one counts from zero: what it shows, it accepted after the fault).
        report["speculation"] = {"after_reference": await _speculation(api), "after_rounds": []}
        report["rounds"] = []
        for index in range(options.repeat):
            result = await run_round(ctx, index)
            if exp.name != "drain":  # after a drain the server is gone
                report["speculation"]["after_rounds"].append(await _speculation(api))
            found = result.pop("violations")
            result["violations"] = {k: n for k, n in found.counts.items() if n}
            violations.merge(found)
            report["rounds"].append(result)
    finally:
        await api.close()
    return _summarise(report, violations, clock)


async def _steady_state(api: ServerAPI, target: Target, clock: float,
                        violations: Violations, spare: bool = False) -> dict:
    """Healthy, state readable and ready, and a probe request streams cleanly; with spare,
    the spare engine core loaded too (a fault "with a spare" must find one ready)."""
    started = time.monotonic()
    while (health := await api.health()) != 200:
        # A server that is recovering (503) gets time; one that does not answer at all, less.
        waited = time.monotonic() - started
        if waited > STEADY_TIMEOUT_S or (health == 0 and waited > UNREACHABLE_TIMEOUT_S):
            break
        await asyncio.sleep(0.5)
    if health != 200:
        raise UserInputError(f"{target.url}/health answered {health or 'nothing'}: the server "
                             "is not ready")
    try:
        state = await api.state()
    except PermissionError as error:
        raise UserInputError(str(error)) from None
    model = await api.model_id()
    # Two tokens: enough to prove the path, and short of the index a demux mutation hits.
    probe = Recorder(target.url, target.headers(), clock, 120)
    await probe.start(StreamSpec("probe", "/v1/messages", {
        "model": model, "max_tokens": 2, "stream": True, "temperature": 0,
        "messages": message("Say hello.")}, role="probe"))
    await probe.close()
    rows = check_history(probe.histories, violations)
    idle, _ = await api.state_until(lambda s: not s.requests and s.batch.running == 0, 60, 0.1)
    spare_ready = None
    if spare:
        _, spare_ready = await api.state_until(
            lambda s: any(e.kind == "spare_core_ready" for e in s.events), STEADY_TIMEOUT_S, 0.5)
    return {"health": health, "status": state.replica.status, "model": model,
            "probe": rows[0]["class"], "baseline_used_blocks": idle.kv.used_blocks,
            "spare_core_ready": spare_ready, "state": idle}


async def _speculation(api: ServerAPI) -> dict:
    """Speculative decoding's counts of the engine core serving now (/v1/state)."""
    return (await api.state()).speculation.to_wire()


async def _facts(api: ServerAPI, state: StateSnapshot) -> ServerFacts:
    model = await api.model_id()
    base = await api.count_tokens(model, message("x"))
    filled = await api.count_tokens(model, message("x " + FILLER * 10))
    budget = state.batch.token_budget or 1024
    return ServerFacts(model, budget, state.batch.max_prefill_chunk or budget,
                       state.replica.max_model_len, state.kv.num_blocks, state.kv.block_size,
                       max(1.0, (filled - base) / 10))


async def _reference(ctx: Context, violations: Violations) -> dict:
    """The fault-free run of the round's greedy and seeded streams (all at once, or one at a
    time when the experiment itself changes the batching)."""
    if ctx.exp.reference is None:
        return {"mode": None}
    specs = [s for s in workload(ctx.exp, ctx.facts, ctx.num_streams, ctx.max_tokens, ctx.seed, 0)
             if s.role in ("decode", "prefix-sharer") and (s.greedy or s.seeded)]
    recorder = Recorder(ctx.target.url, ctx.target.headers(), ctx.clock, ctx.timeout_s)
    started = time.monotonic()
    try:
        if ctx.exp.reference == "solo":
            for spec in specs:
                await recorder.start(spec)
        else:
            await asyncio.gather(*(recorder.start(spec) for spec in specs))
    finally:
        await recorder.close()
    if ctx.exp.reference == "batch":  # one token per step, all streams in each step
        ctx.facts.step_s = (time.monotonic() - started) / (ctx.max_tokens + 1)
    rows = check_history(recorder.histories, violations)
    ctx.reference = {row["name"]: row["token_ids"] for row in rows if row["class"] == "complete"}
    return {"mode": ctx.exp.reference, "streams": sorted(ctx.reference),
            "step_s": ctx.facts.step_s}


def _summarise(report: dict, violations: Violations, clock: float) -> dict:
    rounds = report.get("rounds", [])
    faults = [r["fault"] for r in rounds]
    recoveries = [f["recovery_s"] for f in faults if f.get("recovery_s") is not None]
    content = [c for r in rounds for c in r["content"]]
    streams = [{**row, "round": r["round"]} for r in rounds for row in r["streams"]]
    classes: dict[str, int] = {}
    for row in streams:
        classes[row["class"]] = classes.get(row["class"], 0) + 1
    report.update({
        "ok": violations.ok,
        "duration_s": time.monotonic() - clock,
        "violations": violations.counts,
        "violation_details": violations.details[:200],
        "recovery_s": max(recoveries) if recoveries else None,
        "recovery_s_per_fault": recoveries,
        "faults": faults,
        "streams": streams,
        "classes": classes,
        "content": {"audited": len(content),
                    "within_tolerance": sum(not c["off_argmax"] for c in content),
                    "compared": sum(c["identical_to_fault_free"] is not None for c in content),
                    "identical_to_fault_free": sum(bool(c["identical_to_fault_free"])
                                                   for c in content),
                    "streams": content},
    })
    for r in rounds:
        del r["streams"], r["content"], r["fault"]
    return report
