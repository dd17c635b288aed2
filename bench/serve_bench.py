"""The gateway's cost: `tokstream serve` under 64 concurrent streaming clients against
`tokstream bench` (the engine alone, no HTTP) on the same workload, in one run. Writes JSON.

    .venv/bin/python bench/serve_bench.py            # -> bench/results/serve_bench.json
    .venv/bin/python bench/serve_bench.py --model dummy:tiny --output-len 32 --json /tmp/x.json

Workload: the same random prompts `tokstream bench` draws (its generator and seed), input 128
and output 128 tokens, ignore_eos, greedy, all 64 at once. The server is driven over
/v1/completions with token-id prompts and `stream: true` by a small asyncio HTTP/1.1 client in
this process (one connection per stream) that times every token event: TTFT from sending the
request to the first token event, ITL as the gaps between token events (a merged event's extra
tokens count as zero gaps), output tokens/s over the whole run. The two runs happen one after
the other, never at once (2 cores). The ratio is serve / bench output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokstream.bench import BenchSpec, random_prompts  # noqa: E402
from tokstream.stats import percentiles  # noqa: E402
from tokstream.config import SchedulerConfig  # noqa: E402
from tokstream.gateway_config import AdmissionConfig  # noqa: E402
from tokstream.kernels import cpu_build  # noqa: E402
from tokstream.serve_process import ServeProcess  # noqa: E402


def run_offline_bench(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        done = subprocess.run([sys.executable, "-m", "tokstream", "bench", "--model", args.model,
                        "--dtype", args.dtype, "--num-requests", str(args.num_requests),
                        "--input-len", str(args.input_len), "--output-len",
                        str(args.output_len), "--concurrency", str(args.concurrency),
                        "--seed", str(args.seed), "--json", out], cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not os.path.exists(out):
            raise RuntimeError(f"tokstream bench failed:\n{done.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def start_server(args) -> ServeProcess:
    """`tokstream serve` on a free port, in its own process group, stopped whole."""
    return ServeProcess(["--model", args.model, "--dtype", args.dtype, "--port", "0",
                         "--max-num-seqs", str(max(SchedulerConfig.max_num_seqs,
                                                   args.concurrency)),
                         "--max-waiting-requests", str(max(AdmissionConfig.max_waiting_requests,
                                                           args.num_requests))],
                        new_session=True, reap=True, stop_timeout_s=30)


async def stream_one(host: str, port: int, body: dict) -> tuple[float, list[tuple[float, int]]]:
    """(send time, [(arrival time, tokens in event)]) for one streaming completion."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    sent = time.perf_counter()
    # The server's own address as the Host: it refuses names that are not its own.
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (host.encode(), port, len(payload)) + payload)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    events: list[tuple[float, int]] = []
    buffer = b""
    done = False
    while not done:
        size_line = await reader.readline()  # chunked transfer encoding
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        buffer += await reader.readexactly(size + 2)
        now = time.perf_counter()
        *complete, buffer = buffer.split(b"\n\n")
        for event in complete:
            data = event.rpartition(b"data: ")[2]
            if data.startswith(b"[DONE]"):
                done = True
            elif b'"token_ids"' in data:
                events.append((now, len(json.loads(data)["tokstream"]["token_ids"])))
    writer.close()
    return sent, events


async def drive_server(host: str, port: int, prompts: list[list[int]], args) -> dict:
    def body(prompt):
        return {"model": args.model, "prompt": prompt, "max_tokens": args.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True}

    await stream_one(host, port, body(prompts[0]))  # warm-up
    semaphore = asyncio.Semaphore(args.concurrency)

    async def limited(prompt):
        async with semaphore:
            return await stream_one(host, port, body(prompt))

    started = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    elapsed = time.perf_counter() - started
    ttft, itl, output_tokens = [], [], 0
    for sent, events in results:
        output_tokens += sum(n for _, n in events)
        ttft.append(events[0][0] - sent)
        for (a, _), (b, n) in zip(events, events[1:]):
            itl.extend([b - a] + [0.0] * (n - 1))
    return {"elapsed_s": elapsed, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + len(prompts) * args.input_len) / elapsed,
            "ttft_s": percentiles(ttft), "itl_s": percentiles(itl)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results",
                                                      "serve_bench.json"))
    args = parser.parse_args()

    from tokstream.model.source import resolve_model
    from tokstream.text.tokenizer import load_tokenizer

    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    spec = BenchSpec(args.num_requests, args.input_len, args.output_len, args.concurrency,
                     args.seed)
    special = set(source.config.eos_token_ids) | set(tokenizer.eos_token_ids)
    prompts = random_prompts(spec, source.config.vocab_size, special)

    load_before = os.getloadavg()
    offline = run_offline_bench(args)
    with start_server(args) as server:
        served = asyncio.run(drive_server(*server.host_port, prompts, args))
    ratio = served["output_tokens_per_s"] / offline["output_tokens_per_s"]
    result = {
        "workload": {"model": args.model, "dtype": offline["dtype"],
                     "num_requests": args.num_requests, "concurrency": args.concurrency,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "ignore_eos": True, "greedy": True},
        "serve": served,
        "bench": {k: offline[k] for k in ("elapsed_s", "output_tokens", "output_tokens_per_s",
                                          "total_tokens_per_s", "ttft_s", "itl_s", "step_ms",
                                          "preemptions")},
        "serve_over_bench_output_tokens_per_s": ratio,
        "load_average_before": load_before,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_build.cpu_model(),
        "cpu_flags": [f for f in cpu_build.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"serve {served['output_tokens_per_s']:.1f} output tok/s vs bench "
          f"{offline['output_tokens_per_s']:.1f}: ratio {ratio:.3f}; serve TTFT p50 "
          f"{served['ttft_s']['p50'] * 1000:.0f} ms p99 {served['ttft_s']['p99'] * 1000:.0f} ms,"
          f" ITL p50 {served['itl_s']['p50'] * 1000:.1f} ms p99 "
          f"{served['itl_s']['p99'] * 1000:.1f} ms -> {args.json}")


if __name__ == "__main__":
    main()
