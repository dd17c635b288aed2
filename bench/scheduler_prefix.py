"""Scheduler scenario (a), shared prefix: one long common system prompt with short distinct user
parts, Poisson arrivals, the same requests with the prefix cache on and off."""

from __future__ import annotations

import random

from scheduler_driver import Arrival, drive, engine, random_tokens
from scheduler_results import target
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams
from tokstream.stats import percentiles


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
