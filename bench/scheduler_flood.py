"""Scheduler scenario (b), long-prompt flood: closed-loop chat streams with and without long
prompts arriving, at each token budget and with chunked prefill off; the chat ITL in the
flood's window and the budget dial chosen from it."""

from __future__ import annotations

import itertools
import os
import random
import sys
import time

from scheduler_driver import Arrival, Run, drive, engine, random_tokens
from scheduler_results import rounded, target
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams
from tokstream.stats import percentiles


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
