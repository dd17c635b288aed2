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
This file is the run; its parts are scheduler_driver (timed arrivals fed to the engine core,
a fresh warmed engine), one module per scenario (scheduler_prefix, scheduler_flood,
scheduler_tenants, scheduler_pool) and scheduler_results (rounding, targets, the file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scheduler_flood import flood  # noqa: E402
from scheduler_pool import pool  # noqa: E402
from scheduler_prefix import shared_prefix  # noqa: E402
from scheduler_results import rounded, write_json  # noqa: E402
from scheduler_tenants import hot_tenant  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "scheduler_bench.json")
# In the order a full run measures them; --only names them.
SCENARIOS = {"shared_prefix": shared_prefix, "flood": flood, "hot_tenant": hot_tenant,
             "pool": pool}


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the scenarios chosen to run, in the order given."""
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
    return args, chosen


def previous_results(path: str) -> dict:
    """The results file as last written: a partial rerun keeps the other scenarios' results."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_scenario(name: str, args) -> dict:
    """One scenario's results with the date, load and arguments of its run, rounded."""
    print(f"{name} ...", file=sys.stderr)
    began = time.perf_counter()
    run_info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "loadavg_at_start": os.getloadavg()[0], "args": dict(vars(args))}
    result = SCENARIOS[name](args)
    result["wall_s"] = time.perf_counter() - began
    result["loadavg_after"] = os.getloadavg()[0]  # other users of the machine show here
    return rounded({**run_info, **result})


def main() -> None:
    args, chosen = parse_args()
    out = previous_results(args.out)
    out.update({"model": args.model, "dtype": args.dtype, "host_cores": os.cpu_count()})
    started = time.perf_counter()
    for name in chosen:
        out[name] = run_scenario(name, args)
        print(json.dumps(out[name]["targets"], indent=1), file=sys.stderr)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(args.out, out)
    print(f"wrote {args.out} ({out['wall_s']} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
