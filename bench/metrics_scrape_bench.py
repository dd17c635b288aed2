"""What 100 clients looping `GET /metrics` cost a running stream, before and after the shared
core snapshot (issue 15), side by side in one run. Writes JSON.

    nice -n 15 .venv/bin/python bench/metrics_scrape_bench.py --baseline-root /tmp/old-checkout
        # -> bench/results/metrics_scrape_bench.json

For each source tree (this one, and --baseline-root when given: a checkout of an older commit)
a `tokstream serve --profile ci` (dummy:tiny) runs one streaming /v1/completions request of
--tokens tokens (ignore_eos, greedy), first alone, then while --scrapers asyncio clients loop
GET /metrics without pause (in a separate process) for longer than it lasts. Reported per tree and phase: the stream's duration,
its median and p99 gap between token events, /metrics latency p50/p99 and scrapes per second.
The server runs one tree at a time; the clients share the machine with it, as in the probe.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokstream.serve_process import ServeProcess  # noqa: E402
from tokstream.stats import percentile  # noqa: E402


def start_server(root: str) -> ServeProcess:
    """`tokstream serve --profile ci` of the tree at root (its code, its profiles)."""
    return ServeProcess(["--profile", "ci", "--port", "0"], cwd=root, env={"PYTHONPATH": root},
                        stop_timeout_s=30, reap=True).start()


async def one_stream(url: str, tokens: int) -> dict:
    body = {"model": "dummy:tiny", "prompt": [5, 6, 7, 8], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"token_ids"' in line:
                    times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"seconds": round(times[-1] - started, 3), "token_events": len(times),
            "gap_ms_p50": round(percentile(gaps, 50) * 1000, 2),
            "gap_ms_p99": round(percentile(gaps, 99) * 1000, 2)}


SCRAPER = """
import asyncio, json, sys, time
import httpx

async def main(url, n, seconds):
    latencies = []
    async def scrape(client, until):
        while time.perf_counter() < until:
            started = time.perf_counter()
            await client.get("/metrics")
            latencies.append(time.perf_counter() - started)
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        until = time.perf_counter() + seconds
        await asyncio.gather(*(scrape(client, until) for _ in range(n)))
    print(json.dumps(latencies))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
"""


def scraped_stream(url: str, tokens: int, scrapers: int, seconds: float) -> dict:
    """The stream, measured here, while a separate process runs the scrapers (so their own
    CPU use does not distort this process's clock readings)."""
    scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, url, str(scrapers),
                                str(seconds)], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the scrapers are all looping before the stream starts
    stream = asyncio.run(one_stream(url, tokens))
    latencies = json.loads(scraper.communicate(timeout=seconds + 120)[0])
    return {**stream, "scrapes": len(latencies),
            "scrapes_per_s": round(len(latencies) / seconds, 1),
            "metrics_ms_p50": round(percentile(latencies, 50) * 1000, 1),
            "metrics_ms_p99": round(percentile(latencies, 99) * 1000, 1)}


def measure(root: str, tokens: int, scrapers: int) -> dict:
    server = start_server(root)
    url = server.url
    try:
        asyncio.run(one_stream(url, 8))  # warm-up
        alone = asyncio.run(one_stream(url, tokens))
        # The scrapers run for a fixed time that outlasts the stream (it took alone["seconds"]
        # alone; at the 10x slowdown it would still fit).
        loaded = scraped_stream(url, tokens, scrapers, max(10.0, 12 * alone["seconds"]))
    finally:
        server.stop()
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"root": root, "commit": commit, "alone": alone, "with_scrapers": loaded,
            "slowdown": round(loaded["seconds"] / alone["seconds"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--scrapers", type=int, default=100)
    parser.add_argument("--baseline-root", default=None)
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results",
                                                       "metrics_scrape_bench.json"))
    args = parser.parse_args()
    runs = {"current": measure(ROOT, args.tokens, args.scrapers)}
    if args.baseline_root:
        runs["baseline"] = measure(args.baseline_root, args.tokens, args.scrapers)
    result = {"runs": runs, "tokens": args.tokens, "scrapers": args.scrapers,
              "conditions": {"load_average_after": os.getloadavg(),
                             "cpus": os.cpu_count(), "server": "--profile ci (dummy:tiny)",
                             "command": " ".join(["bench/metrics_scrape_bench.py"]
                                                 + sys.argv[1:])}}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
