"""Achieved memory bandwidth of the Triton decode-attention kernel against a measured
device-to-device copy on the same GPU, at Llama-8B's layer shape (32 query heads, 8 KV heads of
128, bfloat16, 16-token blocks), for several batch x context points; the issue's target is
70%+ of the copy's bandwidth at batch 64 x 4k context.

    python bench/kernel_bandwidth.py --json bench/results/kernel_bandwidth.json
    python bench/kernel_bandwidth.py --device cpu   # plumbing only: the interpreter, tiny sizes

Bytes counted for the kernel: every key and value it must read (context x kv_heads x head_dim
x 2 bytes x 2) plus the queries, block tables and output; for the copy: bytes read + written.
Timing: CUDA events around each call after a warm-up, median of the repeats; the KV pool is
larger than the GPU's L2 cache and each repeat reads it afresh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys


def _time_ms(fn, repeats: int, device: str) -> float:
    import torch

    fn()  # warm-up (compilation, autotuning of nothing, allocator)
    if device == "cpu":
        import time

        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: str, size_bytes: int, repeats: int) -> dict:
    import torch

    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), repeats, device)
    return {"bytes": size_bytes, "ms": ms, "gb_per_s": 2 * size_bytes / ms / 1e6}


def decode_point(device: str, batch: int, context: int, heads: int, kv_heads: int,
                 head_dim: int, repeats: int, num_splits: int | None = None) -> dict:
    """num_splits None: the kernel's own choice (what serving uses)."""
    import torch

    from tokstream.kernels.paged_decode_attention import paged_decode_attention

    block_size = 16
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.empty(kv_heads, num_blocks, block_size, head_dim, dtype=torch.bfloat16,
                          device=device).normal_()
    v_cache = torch.empty_like(k_cache).normal_()
    # Each sequence's blocks scattered over the pool, as after a while of serving.
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
    ms = _time_ms(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                 head_dim ** -0.5, num_splits=num_splits),
                  repeats, device)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    other = 2 * q.numel() * 2 + tables.numel() * 8 + lens.numel() * 8
    return {"batch": batch, "context": context, "num_splits": num_splits or "auto", "ms": ms,
            "kv_bytes": kv_bytes,
            "gb_per_s": (kv_bytes + other) / ms / 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    if args.device == "cpu":
        heads, kv_heads, head_dim = 4, 2, 32
        points = [(2, 64, None), (2, 64, 2)]
        copy_bytes, repeats = 1 << 20, 2
        name = "cpu (Triton interpreter: plumbing only, not a bandwidth)"
    else:
        heads, kv_heads, head_dim = 32, 8, 128
        # The target point first; then its split count forced (to tune the chooser), then
        # other batch x context points.
        points = [(64, 4096, None), (64, 4096, 1), (64, 4096, 2), (64, 4096, 4),
                  (1, 4096, None), (8, 4096, None), (32, 2048, None), (128, 1024, None),
                  (64, 512, None)]
        copy_bytes, repeats = 2 << 30, args.repeats
        name = torch.cuda.get_device_name(0)
    copy = copy_bandwidth(args.device, copy_bytes, repeats)
    results = []
    for batch, context, splits in points:
        point = decode_point(args.device, batch, context, heads, kv_heads, head_dim, repeats,
                             splits)
        point["share_of_copy"] = point["gb_per_s"] / copy["gb_per_s"]
        results.append(point)
        print(f"batch {batch:4d} x {context:5d} tokens, splits {point['num_splits']}: "
              f"{point['ms']:.3f} ms, "
              f"{point['gb_per_s']:.0f} GB/s = {point['share_of_copy']:.0%} of the copy's "
              f"{copy['gb_per_s']:.0f} GB/s")
    target = results[0]
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": name, "shape": {"heads": heads, "kv_heads": kv_heads,
                                        "head_dim": head_dim, "dtype": "bfloat16",
                                        "block_size": 16},
              "copy": copy, "points": results,
              "target": {"point": f"batch {target['batch']} x {target['context']}",
                         "share_of_copy": target["share_of_copy"], "wanted": 0.7,
                         "met": target["share_of_copy"] >= 0.7}}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
