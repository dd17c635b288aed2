"""Scheduler scenario (c), hot tenant: one tenant at 10x the others' rate with equal weights,
the fair policy against fcfs; each tenant's throughput set against its max-min fair share."""

from __future__ import annotations

import random

from scheduler_driver import Arrival, drive, engine, random_tokens
from scheduler_results import rounded, target
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams
from tokstream.stats import jain_index


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
