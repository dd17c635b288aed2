"""What one /v1/state costs with many live requests: opens --live streaming requests against a
running server, waits until all of them are live, then reads /v1/state --samples times, one
after another, and reports the client-side time, the server's own build time (build_ms:
waiting for the engine core's snapshot plus the gateway's part) and the reply's size.

    tokstream serve --profile ci --port 8820 --max-num-seqs 256 --num-blocks 8192 \\
        --max-waiting-requests 512 &
    .venv/bin/python bench/state_cost.py --url http://127.0.0.1:8820 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import httpx


async def stream(client: httpx.AsyncClient, index: int, stop: asyncio.Event) -> None:
    body = {"model": "dummy:tiny", "max_tokens": 1500, "stream": True, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": f"request {index}"}]}
    async with client.stream("POST", "/v1/messages", json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_bytes():
            if stop.is_set():
                return


async def measure(args) -> dict:
    limits = httpx.Limits(max_connections=args.live + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=300, limits=limits) as client:
        stop = asyncio.Event()
        streams = [asyncio.create_task(stream(client, i, stop)) for i in range(args.live)]
        try:
            deadline = time.monotonic() + 300
            while True:
                state = (await client.get("/v1/state")).json()
                if len(state["requests"]) >= args.live:
                    break
                if time.monotonic() > deadline or any(t.done() for t in streams):
                    raise SystemExit(f"only {len(state['requests'])} requests went live")
                await asyncio.sleep(0.5)
            rows = []
            for _ in range(args.samples):
                started = time.perf_counter()
                response = await client.get("/v1/state")
                wall_ms = (time.perf_counter() - started) * 1000
                state = response.json()
                rows.append({"wall_ms": wall_ms, "build_ms": state["build_ms"],
                             "core_wait_ms": state["timing"]["core_wait_ms"],
                             "gateway_build_ms": state["timing"]["gateway_build_ms"],
                             "bytes": len(response.content),
                             "live": len(state["requests"]),
                             "running": state["batch"]["running"]})
        finally:
            stop.set()
            await asyncio.gather(*streams, return_exceptions=True)
    summary = {key: {"median": statistics.median(r[key] for r in rows),
                     "max": max(r[key] for r in rows)}
               for key in ("wall_ms", "build_ms", "core_wait_ms", "gateway_build_ms", "bytes")}
    return {"url": args.url, "live": args.live, "samples": args.samples,
            "load_average": os.getloadavg(),
            "running": rows[-1]["running"], "summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--live", type=int, default=256)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
