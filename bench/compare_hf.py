"""Side by side in one run: this machine's floors, Hugging Face transformers' static batch,
and tokstream on the same weights, dtype and workload. Writes one JSON with ratios.

    .venv/bin/python bench/compare_hf.py --dtype bfloat16 --json bench/results/compare_hf.json

Each contender runs in its own subprocess, one after another, so no two sets of torch threads
ever compete for the cores (two would make the numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section_floors(args) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count())
    out = {}
    src = torch.ones(256 * 2**20 // 4)  # 256 MiB
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    out["memory_bandwidth_gb_s"] = 2 * src.numel() * 4 / best / 1e9  # read + write
    for dtype in ("float32", "bfloat16"):
        a = torch.randn(2048, 2048).to(getattr(torch, dtype))
        b = torch.randn(2048, 2048).to(getattr(torch, dtype))
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(5))
        out[f"matmul_gflop_s_{dtype}"] = 2 * 2048**3 / best / 1e9
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def section_hf(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokstream.bench import BenchSpec, random_prompts
    from tokstream.model.source import resolve_model
    from tokstream.model.weights import hf_config_dict, load_state_dict

    torch.set_num_threads(os.cpu_count())
    source = resolve_model(args.model)
    c = source.config
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig.from_dict(hf_config_dict(c))
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.load_state_dict(load_state_dict(source, dtype), strict=False)
    model.tie_weights()
    spec = BenchSpec(args.num_requests, args.input_len, args.output_len, args.num_requests)
    prompts = torch.tensor(random_prompts(spec, c.vocab_size, set(c.eos_token_ids)))
    with torch.inference_mode():
        model.generate(prompts[:2, :16], max_new_tokens=2, do_sample=False)  # warm-up
        prefill_s = _timed(lambda: model(prompts, use_cache=True))
        start = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                             max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                             do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    decode_s = max(elapsed - prefill_s, 1e-9)
    return {
        "elapsed_s": elapsed, "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "prefill_s": prefill_s,
        "decode_output_tokens_per_s": generated / decode_s,
        "decode_step_ms": decode_s / args.output_len * 1000,
    }


def section_tokstream(args, concurrency: int, num_requests: int) -> dict:
    from tokstream.bench import BenchSpec, bench_config, run_bench
    from tokstream.engine.llm import LLM

    spec = BenchSpec(num_requests, args.input_len, args.output_len, concurrency)
    config = bench_config(args.model, args.dtype, "cpu", spec)
    config.scheduler.max_num_batched_tokens = args.max_num_batched_tokens
    with LLM(config) as llm:
        return run_bench(llm, spec)


def run_section(name: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name] + _passthrough(args)
    print(f"[compare_hf] running {name} ...", file=sys.stderr, flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
        raise SystemExit(f"section {name} failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _passthrough(args) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype, "--num-requests", str(args.num_requests),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--sequential-requests", str(args.sequential_requests),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens)]


def floors_for(args, floors: dict) -> dict:
    """The machine's lower bounds on time for this workload, from the measured floors."""
    from tokstream.config import dtype_bytes
    from tokstream.model.source import resolve_model

    c = resolve_model(args.model).config
    peak = floors[f"matmul_gflop_s_{args.dtype}"] * 1e9
    bandwidth = floors["memory_bandwidth_gb_s"] * 1e9
    head = c.vocab_size * c.hidden_size
    body = c.num_params - head * (1 if c.tie_word_embeddings else 2)  # no embedding lookup FLOPs
    n, i, o = args.num_requests, args.input_len, args.output_len
    attention_per_token = 4 * c.num_layers * c.num_heads * c.head_dim  # QK^T and PV, per key
    prefill_flops = 2 * body * n * i + attention_per_token * n * i * i / 2 + 2 * head * n

    def decode_step_s(batch: int, context: int) -> float:
        flops = 2 * (body + head) * batch + attention_per_token * batch * context
        bytes_read = c.weight_bytes(args.dtype) + batch * context * c.kv_bytes_per_token(args.dtype)
        return max(flops / peak, bytes_read / bandwidth)

    mid = i + o // 2
    workload_s = prefill_flops / peak + o * decode_step_s(n, mid)
    return {"workload_s": workload_s, "prefill_s": prefill_flops / peak,
            "decode_step_ms_batch_1": decode_step_s(1, mid) * 1000,
            f"decode_step_ms_batch_{n}": decode_step_s(n, mid) * 1000,
            "weights_bytes": c.weight_bytes(args.dtype), "dtype_bytes": dtype_bytes(args.dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sequential-requests", type=int, default=4,
                        help="Requests served one at a time, for the batching ratio.")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)

    if args.section:
        if args.section == "floors":
            result = section_floors(args)
        elif args.section == "hf":
            result = section_hf(args)
        elif args.section == "batched":
            result = section_tokstream(args, args.num_requests, args.num_requests)
        elif args.section == "sequential":
            result = section_tokstream(args, 1, args.sequential_requests)
        print(json.dumps(result))
        return

    floors = run_section("floors", args)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host_cores": os.cpu_count(),
              "workload": {"model": args.model, "dtype": args.dtype,
                           "num_requests": args.num_requests, "input_len": args.input_len,
                           "output_len": args.output_len},
              "floors": floors, "workload_floor": floors_for(args, floors)}
    report["tokstream_batched"] = run_section("batched", args)
    report["tokstream_sequential"] = run_section("sequential", args)
    if not args.skip_hf:
        report["hf_static_batch"] = run_section("hf", args)
    ours = report["tokstream_batched"]
    seq = report["tokstream_sequential"]
    floor = report["workload_floor"]
    ratios = {
        "batching_speedup": ours["output_tokens_per_s"] / seq["output_tokens_per_s"],
        "fraction_of_floor": floor["workload_s"] / ours["elapsed_s"],
        "decode_step_ms_batch_1": seq["step_ms"]["p50"],
        "decode_step_ms_batch_1_floor": floor["decode_step_ms_batch_1"],
        f"decode_step_ms_batch_{args.num_requests}": ours["decode_step_ms_at_max_batch"]["p50"],
        f"decode_step_ms_batch_{args.num_requests}_floor":
            floor[f"decode_step_ms_batch_{args.num_requests}"],
    }
    if "hf_static_batch" in report:
        hf = report["hf_static_batch"]
        ratios["vs_hf_output_tokens_per_s"] = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    report["ratios"] = ratios
    text = json.dumps(report, indent=2)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text)
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
