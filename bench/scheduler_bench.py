"""Scheduler benchmarks (issue 4). Each scenario is measured side by side in one run, one engine
(one torch worker) at a time, with timed arrivals fed to the engine core between steps:

  shared_prefix  a 1,000-token common system prompt + short user parts: prefix cache on vs off
  flood          chat streams with and without 8k-token prompts arriving; the same flood with
                 chunked prefill off; the token budget dial
  hot_tenant     one tenant sends 10x the others' load, equal weights: fair vs fcfs
  pool           token slots holding live tokens over slots allocated, vs what contiguous
                 max-length reservation would allocate for the same requests

    .venv/bin/python bench/scheduler_bench.py                      # all, ~10 min on 2 cores
    .venv/bin/python bench/scheduler_bench.py --only flood --flood-budgets 64,256

Writes bench/results/scheduler_bench.json (and prints a summary). No torch in this process.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokstream.stats import jain_index, percentiles  # noqa: E402
from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from tokstream.engine.llm import LLM  # noqa: E402
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "scheduler_bench.json")
SCENARIOS = ("shared_prefix", "flood", "hot_tenant", "pool")


# ---------------------------------------------------------------------------- the driver

@dataclass
class Trace:
    """One request as its caller saw it."""

    kind: str
    tenant: str
    arrival: float
    """perf_counter() of its scheduled arrival: TTFT counts any wait for a running step."""
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def itls(self) -> list[tuple[float, float]]:
        """(start, end) of each gap between consecutive tokens."""
        return list(zip(self.token_times, self.token_times[1:]))


@dataclass
class Arrival:
    at: float
    """Seconds after the run starts."""
    request: EngineRequest
    kind: str = "request"


@dataclass
class Run:
    traces: dict[str, Trace]
    elapsed: float
    start: float
    step_tokens: int = 0
    """Tokens computed over all steps (prefill and decode)."""
    steps: int = 0


def drive(core, arrivals: list[Arrival], duration: float | None = None, on_finish=None,
          on_step=None, stop=None) -> Run:
    """Add each arrival when its time comes (between steps), step while there is work, until
    everything finished, `duration` seconds passed or stop(run, now) says so; then abort the
    rest. on_finish(trace, now) may return new arrivals (closed-loop callers)."""
    order = itertools.count()
    heap = [(a.at, next(order), a) for a in arrivals]
    heapq.heapify(heap)
    start = time.perf_counter()
    run = Run({}, 0.0, start)
    while True:
        now = time.perf_counter() - start
        while heap and heap[0][0] <= now:
            arrival = heapq.heappop(heap)[2]
            request = arrival.request
            core.add_request(request)
            run.traces[request.request_id] = Trace(arrival.kind, request.tenant,
                                                   start + arrival.at,
                                                   len(request.prompt_token_ids))
        if (duration is not None and now >= duration) or (stop and stop(run, now)):
            break
        if not core.has_work:
            if not heap:
                break
            time.sleep(max(0.0, heap[0][0] - now))
            continue
        step_id = core.step_id
        deltas = core.step()
        done = time.perf_counter()
        if core.step_id != step_id:
            run.steps += 1
            run.step_tokens += core.last_step.num_tokens
            if on_step is not None:
                on_step(core, done - start)
        for delta in deltas:
            trace = run.traces[delta.request_id]
            trace.token_times += [done] * len(delta.token_ids)
            if delta.finished:
                trace.finish_reason = delta.finish_reason
                for new in (on_finish(trace, done - start) if on_finish else None) or []:
                    heapq.heappush(heap, (max(new.at, done - start), next(order), new))
    run.elapsed = time.perf_counter() - start
    for request_id in list(core.scheduler.requests):
        core.abort(request_id)
    core.step()  # the worker forgets the aborted requests
    return run


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def engine(args, **overrides) -> LLM:
    """A fresh engine with scheduler/cache overrides, warmed by one short request."""
    scheduler = {k: v for k, v in overrides.items() if k in SchedulerConfig.__dataclass_fields__}
    cache = {k: v for k, v in overrides.items() if k in CacheConfig.__dataclass_fields__}
    cache.setdefault("kv_cache_memory", args.kv_cache_memory)
    config = EngineConfig(model=args.model, dtype=args.dtype, scheduler=SchedulerConfig(
        **scheduler), cache=CacheConfig(**cache))
    llm = LLM(config)
    warm = random_tokens(random.Random(-1), 48, llm.core.model_config.vocab_size)
    llm.generate([warm], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return llm


def rounded(value, digits=4):
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def write_json(path: str, result: dict) -> None:
    """The results file, its numbers rounded, its folder made if need be."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rounded(result), f, indent=2)


def target(value, goal: str, met: bool) -> dict:
    return {"value": rounded(value), "target": goal, "met": bool(met)}


# ---------------------------------------------------------------------------- (a) shared prefix

def shared_prefix(args) -> dict:
    """100 requests = one 1,000-token system prompt + 16-48 distinct user tokens, Poisson
    arrivals; the same requests with the prefix cache on and off."""
    results = {}
    for caching in (True, False):
        with engine(args, enable_prefix_caching=caching) as llm:
            core = llm.core
            rng = random.Random(args.seed)
            vocab = core.model_config.vocab_size
            system = random_tokens(rng, args.system_tokens, vocab)
            params = SamplingParams(max_tokens=args.prefix_output, temperature=0, ignore_eos=True)
            at, arrivals = 0.0, []
            for i in range(args.prefix_requests):
                user = random_tokens(rng, rng.randint(16, 48), vocab)
                arrivals.append(Arrival(at, EngineRequest(f"p{i}", system + user, params)))
                at += rng.expovariate(args.prefix_rate)
            hits, queries = core.block_manager.prefix_hits, core.block_manager.prefix_queries
            run = drive(core, arrivals)
            traces = list(run.traces.values())
            ttft = [t.ttft for t in traces if t.ttft is not None]
            decode_tokens = sum(max(0, len(t.token_times) - 1) for t in traces)
            prompt_tokens = sum(t.prompt_len for t in traces)
            # Then a few requests one at a time: TTFT without any queueing.
            alone = []
            for i in range(args.prefix_alone):
                user = random_tokens(rng, 32, vocab)
                alone += [t.ttft for t in drive(core, [Arrival(0.0, EngineRequest(
                    f"alone{i}", system + user, params))]).traces.values()]
            results["cache_on" if caching else "cache_off"] = {
                "ttft_s": percentiles(ttft),
                "ttft_alone_s": percentiles(alone),
                "prompt_tokens": prompt_tokens,
                "prefill_tokens_computed": run.step_tokens - decode_tokens,
                "prefix_cache_hit_tokens": core.block_manager.prefix_hits - hits,
                "prefix_cache_query_tokens": core.block_manager.prefix_queries - queries,
                "elapsed_s": run.elapsed,
                "completed": sum(t.finish_reason is not None for t in traces),
            }
    on, off = results["cache_on"], results["cache_off"]
    ratio_p50 = off["ttft_s"]["p50"] / on["ttft_s"]["p50"]
    ratio_mean = off["ttft_s"]["mean"] / on["ttft_s"]["mean"]
    ratio_alone = off["ttft_alone_s"]["p50"] / on["ttft_alone_s"]["p50"]
    saved = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    return {
        "workload": {"requests": args.prefix_requests, "system_tokens": args.system_tokens,
                     "user_tokens": "16-48", "output_tokens": args.prefix_output,
                     "poisson_rate_per_s": args.prefix_rate,
                     "offered_prefill_tokens_per_s_cache_off": round(
                         args.prefix_rate * off["prompt_tokens"] / args.prefix_requests)},
        **results,
        "ttft_ratio_off_over_on": {"p50": ratio_p50, "mean": ratio_mean,
                                   "alone_p50": ratio_alone},
        "prefill_tokens_saved": saved,
        "targets": {
            "ttft_p50_ratio": target(ratio_p50, ">= 5x lower with the cache (Poisson run)",
                                     ratio_p50 >= 5),
            "ttft_alone_p50_ratio": target(ratio_alone, ">= 5x lower with the cache (one at "
                                           "a time, no queueing)", ratio_alone >= 5),
            "prefill_tokens_saved": target(saved, ">= 0.80", saved >= 0.8),
        },
    }


# ---------------------------------------------------------------------------- (b) long-prompt flood

def flood(args) -> dict:
    """Closed-loop chat streams (short prompts, 128 output tokens, ignore_eos) alone, then with
    8k-token prompts arriving, at each token budget, then with chunked prefill off. One engine;
    the budget and the chunking switch are read afresh every step."""
    runs = {}
    with engine(args, max_num_seqs=args.chat_streams + args.long_prompts + 2) as llm:
        core = llm.core
        live = core.config.scheduler
        vocab = core.model_config.vocab_size
        long_len = min(args.long_tokens, core.max_model_len - 16)
        variants = []
        for b in args.flood_budgets:  # each flood run next to its own no-flood run
            variants += [(f"no_flood_{b}", b, True, 0), (f"flood_{b}", b, True, args.long_prompts)]
        variants += [("flood_chunking_off", args.flood_budgets[-1], False, args.long_prompts)]
        for index, (name, budget, chunked, num_long) in enumerate(variants):
            live.max_num_batched_tokens, live.chunked_prefill = budget, chunked
            rng = random.Random(args.seed * 1000 + index)  # fresh prompts: no cache hits
            chat = SamplingParams(max_tokens=args.chat_output, temperature=0, ignore_eos=True)
            ids = itertools.count()

            def chat_request(at):
                prompt = random_tokens(rng, rng.randint(32, 64), vocab)
                return Arrival(at, EngineRequest(f"chat{next(ids)}", prompt, chat), "chat")

            arrivals = [chat_request(0.05 * i) for i in range(args.chat_streams)]
            long_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            arrivals += [Arrival(args.flood_start + args.flood_gap * i, EngineRequest(
                f"long{i}", random_tokens(rng, long_len, vocab), long_params), "long")
                for i in range(num_long)]

            def stop(run, now):
                if not num_long:
                    return now >= args.no_flood_s
                longs = [t for t in run.traces.values() if t.kind == "long"]
                return (len(longs) == num_long and all(t.token_times for t in longs)
                        and time.perf_counter() - max(t.token_times[0] for t in longs) > 1.0)

            run = drive(core, arrivals, duration=args.flood_timeout, stop=stop,
                        on_finish=lambda t, now: [chat_request(now)] if t.kind == "chat" else [])
            runs[name] = summarize_flood(run, budget, chunked, num_long)
            runs[name]["loadavg_after"] = os.getloadavg()[0]
            print(f"  flood {name}: {rounded(runs[name]['chat_itl_ms'], 1)}", file=sys.stderr)
    for name, summary in runs.items():
        if name.startswith("flood"):
            base = runs[f"no_flood_{summary['token_budget']}"]["chat_itl_ms"]["p99"]
            summary["p99_itl_ratio_vs_no_flood"] = summary["chat_itl_ms"]["p99"] / base
    ratio = {b: runs[f"flood_{b}"]["p99_itl_ratio_vs_no_flood"] for b in args.flood_budgets}
    meeting = [b for b in args.flood_budgets if ratio[b] <= 2.0]
    # The dial: the largest budget that keeps chat p99 ITL within 2x (fastest long prompts).
    chosen = max(meeting) if meeting else min(args.flood_budgets, key=ratio.get)
    best = ratio[chosen]
    return {
        "workload": {"chat_streams": args.chat_streams, "chat_output_tokens": args.chat_output,
                     "chat_prompt_tokens": "32-64", "long_prompts": args.long_prompts,
                     "long_prompt_tokens": long_len, "long_arrivals_s": [
                         args.flood_start + args.flood_gap * i for i in range(args.long_prompts)],
                     "itl_window": "flood runs: chat gaps overlapping [first long arrival, "
                                   "last long first token]; no-flood runs (same budget): all "
                                   "chat gaps after 1 s"},
        "runs": runs,
        "chosen_budget": chosen,
        "dial": [{"budget": b, "p99_itl_ratio": ratio[b],
                  "chat_itl_p99_ms": runs[f"flood_{b}"]["chat_itl_ms"]["p99"],
                  "chat_itl_p99_ms_no_flood": runs[f"no_flood_{b}"]["chat_itl_ms"]["p99"],
                  "long_ttft_s_mean": runs[f"flood_{b}"]["long_ttft_s"]["mean"]}
                 for b in args.flood_budgets],
        "targets": {
            "p99_itl_ratio_with_flood": target(best, "<= 2x the no-flood p99 (chunked, at "
                                               f"budget {chosen})", best <= 2.0),
            "chunking_off_p99_itl_ratio": {
                "value": rounded(runs["flood_chunking_off"]["p99_itl_ratio_vs_no_flood"]),
                "target": "reported for contrast"},
        },
    }


def summarize_flood(run: Run, budget: int, chunked: bool, num_long: int) -> dict:
    traces = list(run.traces.values())
    longs = [t for t in traces if t.kind == "long"]
    chats = [t for t in traces if t.kind == "chat"]
    if num_long:
        window = (min(t.arrival for t in longs),
                  max(t.token_times[0] if t.token_times else float("inf") for t in longs))
    else:
        window = (run.start + 1.0, float("inf"))
    gaps = [end - begin for t in chats for begin, end in t.itls()
            if end > window[0] and begin < window[1]]
    long_ttft = [t.ttft for t in longs if t.ttft is not None]
    return {
        "token_budget": budget, "chunked_prefill": chunked,
        "chat_itl_ms": {k: (v * 1000 if v is not None else None)
                        for k, v in {**percentiles(gaps), "max": max(gaps, default=None)}.items()},
        "chat_itl_count": len(gaps),
        "window_s": (window[1] - window[0]) if num_long else run.elapsed - 1.0,
        "long_ttft_s": percentiles(long_ttft),
        "elapsed_s": run.elapsed, "steps": run.steps,
    }


# ---------------------------------------------------------------------------- (c) hot tenant

def max_min_shares(capacity: float, demands: dict[str, float]) -> dict[str, float]:
    """Water-filling: equal shares, except a tenant asking less gets what it asks."""
    shares, left, open_ = {}, capacity, dict(demands)
    while open_:
        equal = left / len(open_)
        small = {t: d for t, d in open_.items() if d <= equal}
        if not small:
            shares.update({t: equal for t in open_})
            break
        for tenant, demand in small.items():
            shares[tenant] = demand
            left -= demand
            del open_[tenant]
    return shares


def hot_tenant(args) -> dict:
    """One hot tenant at 10x each cold tenant's Poisson rate, identical request shapes, equal
    weights; every tenant asks for more than an equal share, so fair shares are equal. Tokens
    are counted over [warmup, duration] of each run."""
    tenants = ["hot"] + [f"cold{i}" for i in range(args.cold_tenants)]
    rates = {t: args.cold_rate * (10 if t == "hot" else 1) for t in tenants}
    results = {}
    for policy in ("fair", "fcfs"):
        with engine(args, policy=policy, max_num_seqs=args.tenant_max_seqs) as llm:
            core = llm.core
            rng = random.Random(args.seed + 7)
            vocab = core.model_config.vocab_size
            params = SamplingParams(max_tokens=args.tenant_output, temperature=0,
                                    ignore_eos=True)
            arrivals = []
            for tenant in tenants:
                at, i = rng.expovariate(rates[tenant]), 0
                while at < args.tenant_duration:
                    prompt = random_tokens(rng, args.tenant_prompt, vocab)
                    arrivals.append(Arrival(at, EngineRequest(
                        f"{tenant}-{i}", prompt, params, tenant=tenant), tenant))
                    at += rng.expovariate(rates[tenant])
                    i += 1
            run = drive(core, arrivals, duration=args.tenant_duration)
            lo, hi = run.start + args.tenant_warmup, run.start + args.tenant_duration
            span = hi - lo
            tokens = {t: 0 for t in tenants}
            for trace in run.traces.values():
                tokens[trace.tenant] += sum(1 for s in trace.token_times if lo <= s < hi)
            throughput = {t: n / span for t, n in tokens.items()}
            capacity = sum(throughput.values())
            demand = {t: rates[t] * args.tenant_output for t in tenants}
            fair = max_min_shares(capacity, demand)
            of_fair = {t: throughput[t] / fair[t] for t in tenants}
            results[policy] = {
                "output_tokens_per_s": throughput,
                "fair_share_tokens_per_s": fair,
                "share_of_fair": of_fair,
                "min_cold_share_of_fair": min(of_fair[t] for t in tenants if t != "hot"),
                "jain_index": jain_index(list(of_fair.values())),
                "total_output_tokens_per_s": capacity,
                "requests_submitted": {t: sum(1 for a in arrivals if a.kind == t)
                                       for t in tenants},
            }
    worst = results["fair"]["min_cold_share_of_fair"]
    return {
        "workload": {"tenants": tenants, "poisson_rate_per_s": rates,
                     "prompt_tokens": args.tenant_prompt, "output_tokens": args.tenant_output,
                     "max_num_seqs": args.tenant_max_seqs, "duration_s": args.tenant_duration,
                     "measured_from_s": args.tenant_warmup,
                     "demand_output_tokens_per_s": {t: rates[t] * args.tenant_output
                                                    for t in tenants}},
        **results,
        "targets": {
            "cold_tenant_share_of_fair": target(worst, ">= 0.80 each (fair policy)",
                                                worst >= 0.8),
            "jain_index": {"fair": rounded(results["fair"]["jain_index"]),
                           "fcfs": rounded(results["fcfs"]["jain_index"]),
                           "target": "reported (1.0 = perfectly fair)"},
        },
    }


# ---------------------------------------------------------------------------- (d) pool efficiency

def pool(args) -> dict:
    """Steady Poisson load of mixed lengths; after every step (past the warm-up), the token slots
    the running requests fill, against the slots the paged pool has handed out and against what
    contiguous reservation would hold for the same running requests."""
    with engine(args) as llm:
        core = llm.core
        bm, bs = core.block_manager, core.block_manager.block_size
        rng = random.Random(args.seed + 11)
        vocab = core.model_config.vocab_size
        arrivals, at, i = [], 0.0, 0
        while at < args.pool_duration:
            prompt = random_tokens(rng, rng.randint(32, 512), vocab)
            params = SamplingParams(max_tokens=rng.randint(32, args.pool_declared_max),
                                    temperature=0, ignore_eos=True)
            arrivals.append(Arrival(at, EngineRequest(f"r{i}", prompt, params)))
            at += rng.expovariate(args.pool_rate)
            i += 1
        samples = []

        def on_step(core, now):
            if now < args.pool_warmup:
                return
            running = core.scheduler.running
            live = sum(r.num_computed_tokens for r in running)
            samples.append({
                "live": live, "paged": bm.num_used_blocks * bs,
                "max_len": len(running) * core.max_model_len,
                "declared": sum(len(r.prompt_token_ids) + args.pool_declared_max
                                for r in running),
                "running": len(running)})

        drive(core, arrivals, duration=args.pool_duration, on_step=on_step)
    total = {k: sum(s[k] for s in samples) for k in ("live", "paged", "max_len", "declared")}
    paged = total["live"] / total["paged"]
    return {
        "workload": {"poisson_rate_per_s": args.pool_rate, "prompt_tokens": "32-512",
                     "output_tokens": f"32-{args.pool_declared_max}", "block_size": bs,
                     "max_model_len": core.max_model_len, "duration_s": args.pool_duration,
                     "samples": len(samples),
                     "mean_running": sum(s["running"] for s in samples) / max(1, len(samples))},
        "live_over_allocated": {
            "paged": paged,
            "contiguous_max_model_len": total["live"] / total["max_len"],
            "contiguous_prompt_plus_max_tokens": total["live"] / total["declared"]},
        "note": ("contiguous_max_model_len reserves the model's context per request (what the "
                 "vLLM paper's baselines do); contiguous_prompt_plus_max_tokens reserves prompt + "
                 f"a declared max_tokens of {args.pool_declared_max} while each request's real "
                 "output is drawn from 32 up to it"),
        "targets": {"paged_live_over_allocated": target(paged, ">= 0.95", paged >= 0.95)},
    }


# ---------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2")
    add("--dtype", default="auto")
    add("--kv-cache-memory", type=int, default=2 * 2**30, help="KV pool bytes")
    add("--seed", type=int, default=0)
    add("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    add("--out", default=RESULTS)
    # (a)
    add("--system-tokens", type=int, default=1000)
    add("--prefix-requests", type=int, default=100)
    add("--prefix-output", type=int, default=8)
    add("--prefix-rate", type=float, default=4.0, help="requests/s")
    add("--prefix-alone", type=int, default=5, help="requests run one at a time afterwards")
    # (b)
    add("--chat-streams", type=int, default=8)
    add("--chat-output", type=int, default=128)
    add("--long-prompts", type=int, default=2)
    add("--long-tokens", type=int, default=2048,
        help="the issue asks for 8192; on a 2-core CPU one 8k prompt prefilled whole takes "
             "minutes in the reference attention, so the default run uses 2048")
    add("--flood-start", type=float, default=1.0)
    add("--flood-gap", type=float, default=2.0)
    add("--flood-budgets", default="16,32,128,512", help="comma-separated token budgets")
    add("--no-flood-s", type=float, default=8.0)
    add("--flood-timeout", type=float, default=300.0)
    # (c)
    add("--cold-tenants", type=int, default=3)
    add("--cold-rate", type=float, default=3.0, help="requests/s per cold tenant")
    add("--tenant-prompt", type=int, default=64)
    add("--tenant-output", type=int, default=32)
    add("--tenant-max-seqs", type=int, default=8)
    add("--tenant-duration", type=float, default=40.0)
    add("--tenant-warmup", type=float, default=5.0)
    # (d)
    add("--pool-rate", type=float, default=1.5)
    add("--pool-declared-max", type=int, default=256)
    add("--pool-duration", type=float, default=40.0)
    add("--pool-warmup", type=float, default=10.0)
    args = parser.parse_args()
    args.flood_budgets = sorted(int(b) for b in args.flood_budgets.split(","))
    chosen = [s for s in args.only.split(",") if s]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")

    out = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)  # a partial rerun keeps the other scenarios' last results
    out.update({"model": args.model, "dtype": args.dtype, "host_cores": os.cpu_count()})
    started = time.perf_counter()
    for name in chosen:
        print(f"{name} ...", file=sys.stderr)
        began = time.perf_counter()
        run_info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "loadavg_at_start": os.getloadavg()[0], "args": dict(vars(args))}
        result = globals()[name](args)
        result["wall_s"] = time.perf_counter() - began
        result["loadavg_after"] = os.getloadavg()[0]  # other users of the machine show here
        out[name] = rounded({**run_info, **result})
        print(json.dumps(out[name]["targets"], indent=1), file=sys.stderr)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(args.out, out)
    print(f"wrote {args.out} ({out['wall_s']} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
