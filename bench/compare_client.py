"""The one client every server faces: `vllm bench serve` from vLLM's venv (through a launcher
that fixes two of its stream-parsing faults), its warm-up and measured runs, and the figures
kept from its result files."""

from __future__ import annotations

import json
import os
import shlex

from compare_servers import MODEL_NAME, log, run_bounded, tail
from tokstream.stats import percentile

# The summary fields kept from vllm bench serve's result JSON.
BENCH_FIELDS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
    "median_itl_ms", "p99_itl_ms", "mean_itl_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms",
)


# vllm bench serve's stream reader strips each network read (`chunk_bytes.strip()`), so the
# blank line that ends an SSE event is lost, then hands it to StreamedResponseHandler, which
# splits on blank lines and otherwise emits a buffer only when it is `data: ` + valid JSON. An
# event that carries any other line the SSE spec allows, as tokstream's do (`id: 7` before the
# data line, `: ping` keep-alive comments), is never emitted on its own: it is glued to the
# next read, json.loads fails ("Extra data") and the request is marked failed. This launcher
# drops SSE comment lines and id:/event:/retry: lines from each read before that parser sees
# it.
# Second, the client takes the output token count from a chunk's `usage` only when that chunk
# has no choices (vLLM and tokstream send usage in a chunk of its own); llama-server puts usage
# on its last choice chunk, so the client ignored it and re-tokenised the text instead (29-32
# of 32 tokens counted in the smoke run). The launcher splits such a message into the choice
# chunk followed by a usage-only chunk, so every server's own completion_tokens is counted.
# Nothing else changes (no timing, no other parsing). It is used for EVERY server, so all face
# the same client; on vLLM's streams (data lines, separate usage chunk) it is a no-op.
# --no-client-shim runs the stock CLI instead.
CLIENT_SHIM = """import json, re, sys, vllm_peer_version_shim
from vllm.benchmarks.lib import endpoint_request_func as erf
_SKIP = re.compile(rb"^(?::(?: .*)?|(?:id|event|retry):.*)$")
_add_chunk = erf.StreamedResponseHandler.add_chunk
def _split_usage(message):
    if not (message.startswith("data: {") and '"usage"' in message and '"choices"' in message):
        return [message]
    try:
        data = json.loads(message[6:])
    except ValueError:
        return [message]
    if not (data.get("choices") and data.get("usage")):
        return [message]
    usage = data.pop("usage")
    return ["data: " + json.dumps(data), "data: " + json.dumps({"choices": [], "usage": usage})]
def add_chunk(self, chunk_bytes):
    kept = [l for l in chunk_bytes.split(b"\\n") if not _SKIP.match(l.rstrip(b"\\r"))]
    return [m for msg in _add_chunk(self, b"\\n".join(kept).strip()) for m in _split_usage(msg)]
erf.StreamedResponseHandler.add_chunk = add_chunk
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def client_prefix(args, vllm_peer: str) -> list[str]:
    if args.no_client_shim:
        return [vllm_peer]
    return [os.path.join(args.vllm_venv, "bin", "python"), "-c", CLIENT_SHIM]


def bench_cmd(args, vllm_peer: str, port: int, seed: int, num_prompts: int, concurrency: int,
              output_len: int, result_dir: str | None, filename: str | None) -> list[str]:
    cmd = client_prefix(args, vllm_peer) + ["bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
           "--model", MODEL_NAME, "--tokenizer", args.hf_folder,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(output_len), "--ignore-eos",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm"]
    if result_dir:
        cmd += ["--save-result", "--save-detailed", "--result-dir", result_dir,
                "--result-filename", filename]
    return cmd


def client_env() -> dict:
    # The client does no tensor work; one OpenMP thread keeps it from spinning on the cores.
    # VLLM_TARGET_DEVICE as the vllm-peer wrapper sets it (the shim launcher bypasses it).
    return dict(os.environ, OMP_NUM_THREADS="1", VLLM_TARGET_DEVICE="cpu")


def run_workload(args, name: str, vllm_peer: str, port: int, work: str, commands: dict) -> dict:
    """Warm-up, then the concurrent run and the 1-stream run, all with vllm bench serve."""
    out: dict = {}
    warm = bench_cmd(args, vllm_peer, port, seed=1000, num_prompts=4, concurrency=4,
                     output_len=16, result_dir=None, filename=None)
    commands[f"{name}_warmup"] = shlex.join(warm)
    rc = run_bounded(warm, os.path.join(work, f"{name}_warmup.log"), args.bench_timeout,
                     client_env())
    out["warmup_exit_status"] = rc
    runs = [("concurrent", 0, args.num_prompts, args.concurrency)]
    if args.single_prompts > 0:
        runs.append(("single_stream", 1, args.single_prompts, 1))
    for label, seed, n, conc in runs:
        filename = f"{name}_{label}.json"
        cmd = bench_cmd(args, vllm_peer, port, seed, n, conc, args.output_len, work, filename)
        commands[f"{name}_{label}"] = shlex.join(cmd)
        log(f"{name}: {label} ({n} prompts, max concurrency {conc})")
        log_path = os.path.join(work, f"{name}_{label}.log")
        rc = run_bounded(cmd, log_path, args.bench_timeout, client_env())
        out[label] = summarize_bench(os.path.join(work, filename), rc, log_path, n,
                                     args.output_len)
    return out


def summarize_bench(path: str, rc: int, log_path: str, num_prompts: int, output_len: int) -> dict:
    if not os.path.isfile(path):
        return {"error": f"vllm bench serve exited {rc} without a result file",
                "log_tail": tail(log_path)}
    with open(path) as f:
        raw = json.load(f)
    result = {k: raw.get(k) for k in BENCH_FIELDS}
    result["num_prompts"] = raw.get("num_prompts")
    result["max_concurrency"] = raw.get("max_concurrency")
    result["client_exit_status"] = rc
    errors = [e for e in raw.get("errors", []) if e]
    if errors:
        result["errors"] = sorted(set(errors))[:5]
        result["num_errors"] = len(errors)
    # ignore_eos honoured: every request produced exactly output_len tokens.
    lens = raw.get("output_lens") or []
    result["all_requests_full_length"] = (raw.get("completed") == num_prompts
                                          and bool(lens) and all(n == output_len for n in lens))
    # ITL over the gaps between token-carrying chunks only. The client takes a gap at every
    # chunk with choices, so a server that ends with a separate empty-text chunk carrying
    # finish_reason (tokstream does; vLLM puts it on the last token's chunk) adds one
    # near-zero gap per request. Drop gaps past output_tokens - 1 to compare like for like.
    itls = raw.get("itls") or []
    gaps = []
    for itl, n in zip(itls, lens):
        gaps.extend(itl[:max(n - 1, 0)])
    if gaps:
        result["median_itl_ms_token_gaps"] = percentile(gaps, 50) * 1000
        result["p99_itl_ms_token_gaps"] = percentile(gaps, 99) * 1000
    if itls:
        result["mean_chunks_per_request"] = sum(len(i) + 1 for i in itls) / len(itls)
    result["raw_result_file"] = path
    return result
