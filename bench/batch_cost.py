"""What a running Message Batch costs interactive chat, at each --batch-concurrency and
--background-rows-when-busy: two ordinary streams decode alone (baseline), then beside a batch
of long requests that keeps --batch-concurrency of them running; runs alternate (baseline,
batch, baseline, ...) over --runs rounds, on one server per setting. Reported per setting: the
streams' median, p99 and worst token gap and time to first token, against the baseline runs',
and the batch's output tokens a second while it ran beside them.

    nice -n 15 .venv/bin/python bench/batch_cost.py             # SmolLM2; 8 running, 0 and 8
    .venv/bin/python bench/batch_cost.py --model dummy:tiny --concurrency 2 --runs 1

Writes bench/results/batch_cost-<cpu kind>.json (runs under --label are merged into it), with
the CPU model and flags, the load average before each run, the git commit and the command.
Only 127.0.0.1; every request has a timeout and every loop a bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from one_request_cost import ROOT, Stream, chat, machine, ms, percentile, wait_quiet

sys.path.insert(0, str(ROOT))

BATCH_REQUESTS = 16
BATCH_TOKENS = 1024
"""Each batch request's output (ignore_eos): long enough that none ends while the streams
run, so the tokens the running ones gain measure the batch's progress beside them."""
TIMEOUT_S = 180.0


def batch_body(model: str, tag: str) -> dict:
    return {"requests": [{"custom_id": f"r{i}", "params": {
        "model": model, "max_tokens": BATCH_TOKENS, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": f"[{tag} {i}] Summarise the history of "
                                                 "printing in a few paragraphs."}]}}
        for i in range(BATCH_REQUESTS)]}


def background_rows(url: str) -> list[dict]:
    rows = httpx.get(url + "/v1/state", timeout=30).json()["requests"]
    return [row for row in rows if (row.get("priority") or 0) >= 1_000_000]


def background_tokens(url: str) -> int:
    return sum(row["output_tokens"] for row in background_rows(url))


def one_run(url: str, model: str, concurrency: int | None, tag: str) -> dict:
    """Two streams; with concurrency, beside a batch that has that many requests decoding."""
    load = os.getloadavg()
    batch = None
    if concurrency:
        batch = httpx.post(url + "/v1/messages/batches", json=batch_body(model, tag),
                           timeout=TIMEOUT_S).json()
        deadline = time.monotonic() + TIMEOUT_S
        while sum(row["output_tokens"] > 0 for row in background_rows(url)) < concurrency \
                and time.monotonic() < deadline:
            time.sleep(0.02)
    result = {"load_before": [round(x, 2) for x in load]}
    if batch is not None:  # the batch alone for a second: its pace without chat
        alone_from, alone_started = background_tokens(url), time.perf_counter()
        time.sleep(1.0)
        tokens_before = background_tokens(url)
        result["batch_tokens_per_s_alone"] = round(
            (tokens_before - alone_from) / (time.perf_counter() - alone_started), 1)
    started = time.perf_counter()
    streams = [Stream(url, chat(model, f"[{tag}] {prompt}", stream=True))
               for prompt in ("Write a story about a lighthouse.", "Explain how rain forms.")]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.join(TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if batch is not None:
        gained = background_tokens(url) - tokens_before
        after = httpx.get(f"{url}/v1/messages/batches/{batch['id']}", timeout=30).json()
        result["batch_requests_ended_beside"] = after["request_counts"]["succeeded"]
        result["batch_tokens_per_s_beside"] = round(gained / elapsed, 1)
        httpx.post(f"{url}/v1/messages/batches/{batch['id']}/cancel", timeout=30)
        deadline = time.monotonic() + TIMEOUT_S
        while httpx.get(f"{url}/v1/messages/batches/{batch['id']}", timeout=30).json()[
                "processing_status"] != "ended" and time.monotonic() < deadline:
            time.sleep(0.1)
    gaps = [gap for s in streams for gap in s.gaps]
    return {**result,
            "median_gap_ms": ms(statistics.median(gaps) if gaps else None),
            "p99_gap_ms": ms(percentile(gaps, 0.99)),
            "worst_gap_ms": ms(max(gaps, default=None)),
            "ttft_ms": [ms(s.arrivals[0] - started) if s.arrivals else None for s in streams],
            "tokens_per_stream": [len(s.arrivals) for s in streams],
            "stream_errors": [s.error for s in streams if s.error]}


def summary(baselines: list[dict], beside: list[dict]) -> dict:
    def median(runs, key):
        return statistics.median(r[key] for r in runs)

    def ttft(runs):
        return statistics.median(t for r in runs for t in r["ttft_ms"] if t is not None)

    out = {}
    for key in ("median_gap_ms", "p99_gap_ms", "worst_gap_ms"):
        base, with_batch = median(baselines, key), median(beside, key)
        out[key] = {"baseline": base, "beside_batch": with_batch,
                    "ratio": round(with_batch / base, 2)}
    out["ttft_ms"] = {"baseline": ttft(baselines), "beside_batch": ttft(beside),
                      "ratio": round(ttft(beside) / ttft(baselines), 2)}
    out["batch_tokens_per_s_beside"] = median(beside, "batch_tokens_per_s_beside")
    out["batch_tokens_per_s_alone"] = median(beside, "batch_tokens_per_s_alone")
    return out


def main() -> None:
    from tokstream.kernels import cpu_build
    from tokstream.serve_process import ServeProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the server's (SmolLM2)")
    parser.add_argument("--concurrency", default="8", help="--batch-concurrency values")
    parser.add_argument("--rows-when-busy", default="0,8",
                        help="--background-rows-when-busy values")
    parser.add_argument("--runs", type=int, default=3, help="rounds per concurrency")
    parser.add_argument("--label", default="latest")
    args = parser.parse_args()
    path = ROOT / f"bench/results/batch_cost-{cpu_build.cpu_kind()}.json"
    results = {}
    settings = [(int(c), int(rows)) for c in args.concurrency.split(",")
                for rows in args.rows_when_busy.split(",")]
    for concurrency, rows in settings:
        name = f"batch_concurrency={concurrency},background_rows_when_busy={rows}"
        serve_args = ["--port", "0", "--host", "127.0.0.1", "--batch-concurrency",
                      str(concurrency), "--background-rows-when-busy", str(rows)]
        if args.model:
            serve_args += ["--model", args.model]
        if args.model == "dummy:tiny":
            serve_args += ["--profile", "ci"]
        wait_quiet()
        with ServeProcess(serve_args, start_timeout_s=600, reap=True) as server:
            url = server.url
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            one_run(url, model, None, "warm-up")
            baselines, beside = [], []
            for round_ in range(args.runs):
                baselines.append(one_run(url, model, None, f"{name} base {round_}"))
                beside.append(one_run(url, model, concurrency, f"{name} b {round_}"))
                print(json.dumps({"setting": name, "baseline": baselines[-1],
                                  "beside": beside[-1]}), file=sys.stderr, flush=True)
            baselines.append(one_run(url, model, None, f"{name} base last"))
        results[name] = {"summary": summary(baselines, beside),
                                     "baseline_runs": baselines, "beside_batch_runs": beside}
    result = {"machine": machine(), "model": model, "batch_requests": BATCH_REQUESTS,
              "batch_tokens": BATCH_TOKENS,
              "command": " ".join(["python", "bench/batch_cost.py", *sys.argv[1:]]),
              "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "by_setting": results}
    everything = json.loads(path.read_text()) if path.exists() else {}
    everything[args.label] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(everything, indent=1) + "\n")
    print(json.dumps({c: r["summary"] for c, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
