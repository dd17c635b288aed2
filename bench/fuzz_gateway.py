"""Fuzz the gateway with 10,000+ hypothesis-generated requests across every route, then prove it
healthy and leak-free. Writes JSON.

    nice -n 15 .venv/bin/python bench/fuzz_gateway.py          # -> bench/results/fuzz_gateway.json
    .venv/bin/python bench/fuzz_gateway.py --requests 2000 --json /tmp/fuzz.json

Requests are tests/test_server_fuzz.py's REQUESTS strategy (JSON bodies mixing valid fields and
junk for every POST route, /tokenize and /detokenize included, tool histories with odd call
arguments and calls without content, tools, tool_choice and output formats, lone surrogates, raw bytes, GETs on every route and unknown paths,
odd methods, CORS preflights, foreign Host names and wrong content types), sent one at a time
to a `tokstream serve --profile ci` on 127.0.0.1 by tests/test_server_fuzz.send, which checks
each answer (no 5xx; streams end with a final or error event; errors in an API's shape). A
failed check is recorded, not raised, and the run goes on. Afterwards: /health, one clean
stream through the integrity checker, no live request and every KV block free, and the
gateway's descriptors, threads and memory against the values before the run. Bounded by
--max-seconds. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from helpers.serving import ServerProcess, anthropic_body, record  # noqa: E402
from test_server_fuzz import REQUESTS, gateway_resources, send  # noqa: E402
from tokstream.checker import check_streams  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "fuzz_gateway.json")
"""Where the report goes unless --json says otherwise."""


class Stop(Exception):
    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--max-seconds", type=float, default=1500)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--json", default=RESULTS)
    args = parser.parse_args()

    by_route: collections.Counter = collections.Counter()
    statuses: collections.Counter = collections.Counter()
    failures: list[dict] = []
    started = time.monotonic()
    with ServerProcess("--profile", "ci", "--allowed-origins", "https://app.example") as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        server.wait_idle()
        before = gateway_resources(server)

        @seed(args.seed)
        @settings(max_examples=args.requests, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(REQUESTS)
        def fuzz(request):
            if time.monotonic() - started > args.max_seconds:
                raise Stop
            by_route[f"{request['method']} {request['path'][:40]}"] += 1
            try:
                statuses[send(client, request).status_code] += 1
            except AssertionError as error:
                failures.append({"request": repr(request)[:500], "error": str(error)[:500]})
            except httpx.HTTPError as error:
                failures.append({"request": repr(request)[:500],
                                 "error": f"{type(error).__name__}: {error}"[:500]})

        stopped = None
        try:
            fuzz()
        except Exception as error:  # Stop at --max-seconds (hypothesis may wrap it)
            stopped = f"{type(error).__name__}: {error}"[:300]
        elapsed = time.monotonic() - started
        health = client.get("/health").status_code
        _, stream = record(client, "/v1/messages", anthropic_body(max_tokens=6, ignore_eos=True))
        clean = check_streams([stream])
        idle = server.wait_idle()
        after = gateway_resources(server)
    sent = sum(by_route.values())
    leak_free = (after["open_fds"] <= before["open_fds"] + 4
                 and after["threads"] <= before["threads"] + 4)
    ok = (not failures and health == 200 and clean.ok and sent >= args.requests and leak_free)
    result = {
        "ok": ok, "requests": sent, "seconds": round(elapsed, 1), "stopped": stopped,
        "failures": failures[:50], "num_failures": len(failures),
        "five_xx": sum(n for code, n in statuses.items() if code >= 500),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "routes": dict(by_route.most_common()),
        "after": {"health": health, "clean_stream_ok": clean.ok,
                  "live_requests": len(idle["requests"]),
                  "kv_free_blocks": idle["kv"]["free_blocks"],
                  "kv_num_blocks": idle["kv"]["num_blocks"]},
        "gateway_before": before, "gateway_after": after, "leak_free": leak_free,
        "conditions": {"command": "nice -n 15 .venv/bin/python bench/fuzz_gateway.py "
                                  f"--requests {args.requests} --seed {args.seed}",
                       "cpu": platform.processor() or platform.machine(),
                       "load_average": os.getloadavg(), "server": "--profile ci (dummy:tiny)"},
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("ok", "requests", "seconds", "num_failures",
                                             "five_xx", "leak_free")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
