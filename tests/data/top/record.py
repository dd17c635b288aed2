"""Record real /v1/state, /metrics and /v1/state/requests/{id} replies from a server under load,
for `tokstream top`'s replay tests (tests/data/top/frames.json). Drives its own load: streaming
requests from two tenants with a shared system prompt (so blocks are cached and shared) that
overfill a small pool (so requests are preempted); optionally SIGKILLs rank 0 midway (so the
recording holds a recovery).

    tokstream serve --profile ci --port 8818 --num-blocks 256 --max-num-seqs 16 \\
        --tenants tenants.toml        # admin key sk-admin-top, tenants alice and bob
    .venv/bin/python tests/data/top/record.py --url http://127.0.0.1:8818 --kill-rank-at 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx

from tokstream.top.source import COUNTERS

COUNTER_FAMILIES = [name.removesuffix("_total") for name in COUNTERS]

SYSTEM = "You are a terse assistant who answers in one line."
KEYS = {"alice": "sk-alice-top", "bob": "sk-bob-top"}


def load(url: str, tenant: str, stop: threading.Event, rng: random.Random) -> None:
    """Stream requests one after another until stop is set (each bounded by max_tokens)."""
    with httpx.Client(base_url=url, timeout=120,
                      headers={"x-api-key": KEYS[tenant]}) as client:
        while not stop.is_set():
            body = {"model": "dummy:tiny", "max_tokens": rng.randint(20, 100), "stream": True,
                    "temperature": 0, "ignore_eos": True, "system": SYSTEM,
                    "messages": [{"role": "user", "content": f"question {rng.random()} "
                                  * rng.randint(1, 4)}]}
            try:
                with client.stream("POST", "/v1/messages", json=body) as response:
                    for _ in response.iter_bytes():
                        pass
            except httpx.HTTPError:
                time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--admin-key", default="sk-admin-top")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--kill-rank-at", type=int, default=None, help="frame index")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("frames.json"))
    args = parser.parse_args()
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(args.url, tenant, stop, random.Random(i)))
               for i, tenant in enumerate(["alice", "bob"] * (args.clients // 2))]
    for thread in threads:
        thread.start()
    frames = []
    admin = httpx.Client(base_url=args.url, timeout=30, headers={"x-api-key": args.admin_key})
    try:
        time.sleep(args.interval)
        for index in range(args.frames):
            state = admin.get("/v1/state").json()
            # Only the samples top reads (with their HELP and TYPE lines): the full exposition
            # (histograms) would be most of the file.
            metrics = "\n".join(line for line in admin.get("/metrics").text.splitlines()
                                 if any(name in line for name in COUNTER_FAMILIES)) + "\n"
            # The detail replies of the three oldest live requests, as top's detail view reads.
            oldest = sorted(state["requests"], key=lambda r: -r["age_s"])[:3]
            details = {row["id"]: admin.get(f"/v1/state/requests/{row['id']}").json()
                       for row in oldest}
            frames.append({"state": state, "metrics": metrics,
                           "requests": {k: v for k, v in details.items() if "id" in v}})
            print(f"frame {index}: {len(state['requests'])} requests, "
                  f"{state['kv']['used_blocks']} blocks used, {state['replica']['status']}")
            if index == args.kill_rank_at:
                os.kill(state["ranks"][0]["pid"], signal.SIGKILL)
            time.sleep(args.interval)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        admin.close()
    args.out.write_text(json.dumps(frames, indent=None, separators=(",", ":")))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
