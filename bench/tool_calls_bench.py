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
    from helpers.serving import ServerProcess
    from tokstream.checker import check_streams
    from helpers.tool_workload import jobs, problems, record_all

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--kill-every", type=int, default=3,
                        help="SIGKILL rank 0 during every Nth batch (0: never)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--auto", type=int, default=0,
                        help="also N free (tool_choice auto) requests: how often the model "
                             "calls, validly, and whether markup ever reaches the text")
    parser.add_argument("--json", default=os.path.join(ROOT, "bench/results/tool_calls.json"))
    args = parser.parse_args()

    model_args = ["--profile", "ci"] if args.model == "dummy:tiny" else [
        "--profile", "ci", "--model", args.model, "--num-blocks", "2048", "--block-size", "16",
        "--step-timeout", "120"]  # a real model's step on a loaded 2-core machine can pass 30 s
    work = jobs(args.count, args.model, args.max_tokens)
    results, killed_batches, started = [], [], time.monotonic()
    load_before = os.getloadavg()
    with ServerProcess(*model_args, start_timeout=600) as server:
        for b in range(0, len(work), args.batch):
            batch = work[b:b + args.batch]
            kill = args.kill_every and (b // args.batch) % args.kill_every == 1
            to_kill = [server.state()["ranks"][0]["pid"]] if kill else []
            restarts = server.state()["replica"]["restarts"]
            received = [0] * len(batch)

            def on_tokens(j, n, received=received, to_kill=to_kill):
                # Once every stream is a few tokens in: mid-generation, none finished.
                received[j] += n
                if to_kill and min(received) >= 4:
                    pid = to_kill.pop()
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # the batch then counts as not killed
                        print(f"rank pid {pid} was already gone", file=sys.stderr)

            streams = asyncio.run(record_all(server.url, batch, on_tokens))
            server.wait_idle(timeout=300)
            report = check_streams(streams)
            kill = server.state()["replica"]["restarts"] > restarts
            if kill:
                killed_batches.append(b // args.batch)
            for job, stream, checked in zip(batch, streams, report.streams):
                found = problems(job, stream) + [f"{k}: {d}" for k, d in checked.problems]
                results.append({"kind": job.kind, "temperature": job.body["temperature"],
                                "seed": job.body["seed"], "tools": list(job.schemas),
                                "during_rank_kill": bool(kill), "tokens": len(checked.token_ids),
                                "problems": found})
            print(f"batch {b // args.batch}: {sum(not r['problems'] for r in results)}"
                  f"/{len(results)} valid so far, restarts {restarts} -> "
                  f"{server.state()['replica']['restarts']}", file=sys.stderr)
        auto = auto_probe(server.url, args.model, args.auto) if args.auto else None
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
        "auto": auto,
        "failures": [r for r in results if r["problems"]],
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as file:
        json.dump(out, file, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "failures"}, indent=1))
    sys.exit(0 if len(valid) == len(results) else 1)


def auto_probe(url: str, model: str, count: int) -> dict:
    """count streamed tool_choice=auto requests (the model free): calls made, calls whose
    arguments validate, texts that hold tool-call markup."""
    from tokstream.checker import SSERecorder
    from helpers.tool_workload import NAMES, SCHEMAS, Job, streamed
    import httpx
    import jsonschema

    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": s}}
             for n, d, s in zip(NAMES[:2], ("Current weather in a city", "Count things"),
                                SCHEMAS[:2])]
    questions = ["What is the weather in Paris?", "Is it cold in Oslo today?",
                 "Count to 5 for me.", "Tell me a joke."]
    made = valid = leaked = 0
    samples = []
    for i in range(count):
        body = {"model": model, "max_tokens": 160, "stream": True, "seed": i,
                "temperature": (0.0, 0.7)[i % 2], "tools": tools,
                "messages": [{"role": "user", "content": questions[i % len(questions)]}]}
        recorder = SSERecorder()
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=300) as response:
            for chunk in response.iter_bytes():
                recorder.feed(chunk)
        text, calls, _ = streamed(Job("auto", "/v1/chat/completions", body, {}, None),
                                  recorder.stream())
        samples.append({"text": text[:160], "calls": calls})
        leaked += "<tool_call>" in text or "</tool_call>" in text
        made += bool(calls)
        for name, arguments in calls:
            try:
                jsonschema.validate(json.loads(arguments), dict(zip(NAMES, SCHEMAS))[name])
                valid += 1
            except (ValueError, KeyError, jsonschema.ValidationError):
                pass
    return {"requests": count, "with_calls": made, "valid_calls": valid,
            "texts_with_markup": leaked, "samples": samples[:4]}


if __name__ == "__main__":
    main()
