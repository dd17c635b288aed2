"""Constrained generations through a real `tokstream serve`, checked one by one: forced tool
calls on both APIs (OpenAI `required` / named, Anthropic `any` / `tool`) and OpenAI
`response_format` JSON schemas, varied over schemas, seeds and temperatures
(tests/tool_workload.py), streamed in concurrent batches; during some batches rank 0 is
SIGKILLed mid-generation, and those streams resume on the restarted replica. Every stream must
pass the integrity checker, end with a call (or a stop), and parse and validate against its
schema with jsonschema.

    nice -n 15 .venv/bin/python bench/tool_calls_bench.py          # dummy:tiny, 200
    nice -n 15 .venv/bin/python bench/tool_calls_bench.py --model smollm2 --count 60 \\
        --json bench/results/tool_calls_smollm2.json

Writes bench/results/tool_calls.json: counts valid per kind, the problems, restarts, the
machine (CPU model, load average) and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def cpu_model() -> str:
    with open("/proc/cpuinfo") as info:
        return next((line.split(":", 1)[1].strip() for line in info
                     if line.startswith("model name")), platform.processor())


def main() -> None:
    from serving import ServerProcess
    from tokstream.checker import check_streams
    from tool_workload import jobs, problems, record_all

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--kill-every", type=int, default=3,
                        help="SIGKILL rank 0 during every Nth batch (0: never)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", default=os.path.join(ROOT, "bench/results/tool_calls.json"))
    args = parser.parse_args()

    model_args = ["--profile", "ci"] if args.model == "dummy:tiny" else [
        "--profile", "ci", "--model", args.model, "--num-blocks", "2048", "--block-size", "16"]
    work = jobs(args.count, args.model, args.max_tokens)
    results, killed_batches, started = [], [], time.monotonic()
    load_before = os.getloadavg()
    with ServerProcess(*model_args, start_timeout=600) as server:
        for b in range(0, len(work), args.batch):
            batch = work[b:b + args.batch]
            kill = args.kill_every and (b // args.batch) % args.kill_every == 1
            rank = server.state()["ranks"][0]["pid"]
            received = [0] * len(batch)

            def on_tokens(j, n, rank=rank, kill=kill, received=received):
                received[j] += n
                if kill and j == 0 and received[0] >= 20 > received[0] - n:
                    os.kill(rank, signal.SIGKILL)

            streams = asyncio.run(record_all(server.url, batch, on_tokens))
            server.wait_idle(timeout=300)
            report = check_streams(streams)
            if kill:
                killed_batches.append(b // args.batch)
            for job, stream, checked in zip(batch, streams, report.streams):
                found = problems(job, stream) + [f"{k}: {d}" for k, d in checked.problems]
                results.append({"kind": job.kind, "temperature": job.body["temperature"],
                                "seed": job.body["seed"], "tools": list(job.schemas),
                                "during_rank_kill": bool(kill), "tokens": len(checked.token_ids),
                                "problems": found})
            print(f"batch {b // args.batch}: {sum(not r['problems'] for r in results)}"
                  f"/{len(results)} valid so far", file=sys.stderr)
        final = server.state()
    valid = [r for r in results if not r["problems"]]
    out = {
        "command": " ".join(["bench/tool_calls_bench.py", *sys.argv[1:]]),
        "model": args.model, "generations": len(results), "valid": len(valid),
        "valid_fraction": len(valid) / len(results),
        "by_kind": {k: {"count": n, "valid": sum(1 for r in valid if r["kind"] == k)}
                    for k, n in Counter(r["kind"] for r in results).items()},
        "temperatures": sorted({r["temperature"] for r in results}),
        "during_rank_kill": {"count": sum(r["during_rank_kill"] for r in results),
                             "valid": sum(r["during_rank_kill"] for r in valid),
                             "batches": killed_batches},
        "replica_restarts": final["replica"]["restarts"],
        "output_tokens": sum(r["tokens"] for r in results),
        "elapsed_s": round(time.monotonic() - started, 1),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "failures": [r for r in results if r["problems"]],
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as file:
        json.dump(out, file, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "failures"}, indent=1))
    sys.exit(0 if len(valid) == len(results) else 1)


if __name__ == "__main__":
    main()
