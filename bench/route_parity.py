"""The same load through each API route of one server, side by side: `tokstream loadtest`'s
closed loop (same seed, so the same prompts and lengths) against /v1/chat/completions,
/v1/responses and /v1/messages in turn, rounds alternating the order so that drift in the
machine's speed falls on all. What the routes cost beyond the engine shows as ratios of
output tokens/s, TTFT and ITL to the chat route's.

    python bench/route_parity.py --rounds 2 --requests 48 --users 8

Starts its own server (--model, default smollm2) with prefix caching off, so that every run
computes the same prompts from scratch (with it on, the runs after the first found their
prompts cached: the first was 2.4x slower whatever its route), unless --url is given; a
warm-up run on the chat route goes first and is not counted. Writes
bench/results/route_parity-<cpu kind>.json (under --label) with the CPU, its flags, the load
average before each run and every run's summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from compare_machine import host_info, loadavg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tokstream.kernels import cpu_build  # noqa: E402
from tokstream.serve_process import ServeProcess  # noqa: E402

APIS = ("openai", "responses", "anthropic")
"""loadtest --api values: chat completions, the Responses API, the Messages API."""


def run(url: str, api: str, args, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "tokstream", "loadtest", "--url", url, "--api", api,
                    "--mix", "chat", "--arrival", "closed", "--users", str(args.users),
                    "--requests", str(args.requests), "--duration", "0", "--seed", "1",
                    "--model", args.served_name, "--out", str(out)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "report.json").read_text())["summary"]
    return {"output_tokens_per_s": summary["output_tokens_per_s"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "itl_p50_s": summary["itl_s"]["p50"],
            "itl_p99_s": summary["itl_s"]["p99"], "input_tokens": summary["input_tokens"],
            "output_tokens": summary["output_tokens"], "duration_s": summary["duration_s"],
            "completed": summary["completed"],
            "failed": summary["failed"],
            "integrity_failed": summary["integrity"]["streams_failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="A running server (default: start one).")
    parser.add_argument("--model", default="smollm2", help="serve --model (no --url).")
    parser.add_argument("--served-name", default="smollm2", help="The model name to send.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=48, help="Requests of each run.")
    parser.add_argument("--users", type=int, default=8, help="Concurrent streams.")
    parser.add_argument("--label", default="latest")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {api: [] for api in APIS}
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            url = stack.enter_context(ServeProcess([
                "--model", args.model, "--served-model-name", args.served_name,
                "--no-prefix-caching", "--port", "0"])).url
        scratch = stack.enter_context(tempfile.TemporaryDirectory())
        run(url, "openai", args, Path(scratch) / "warm-up")
        for i in range(args.rounds):
            order = APIS if i % 2 == 0 else APIS[::-1]
            for api in order:
                load = loadavg()
                result = run(url, api, args, Path(scratch) / f"{api}{i}")
                runs[api].append({**result, "loadavg_before": load})
                print(api, json.dumps(result), file=sys.stderr)
    median = {api: {key: statistics.median(r[key] for r in results)
                    for key in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s", "itl_p99_s")}
              for api, results in runs.items()}
    chat = median["openai"]
    result = {
        "machine": {**host_info(), "cpu_kind": cpu_build.cpu_kind()},
        "command": " ".join(sys.argv), "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "load": {"mix": "chat", "arrival": "closed", "users": args.users,
                 "requests": args.requests, "seed": 1, "model": args.model},
        "runs": runs, "median": median,
        "ratio_to_chat": {api: {key: round(value / chat[key], 3) for key, value in m.items()}
                          for api, m in median.items()},
    }
    out = ROOT / "bench" / "results" / f"route_parity-{cpu_build.cpu_kind()}.json"
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved[args.label] = result
    out.write_text(json.dumps(saved, indent=1) + "\n")
    print(json.dumps(result["ratio_to_chat"]))


if __name__ == "__main__":
    main()
