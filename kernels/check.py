"""Every Triton kernel against its torch reference at serving shapes, on a device: what the GPU
tests (tests/test_triton_kernels_gpu.py) and scripts/gpu_check.sh run.

    python -m tokstream.kernels.check --device cuda --json kernels.json
    python -m tokstream.kernels.check --device cpu   # Triton's interpreter, small shapes

Exit status 1 when any kernel is off by more than its dtype's tolerance or leaves an output
element unwritten (outputs are filled with NaN first).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-3}


def _max_error(got, expected) -> float:
    """Largest |got - expected|, relative where |expected| > 1 (a dtype's rounding grows with
    the value); inf when an element was never written (it is still NaN)."""
    if got.isnan().any():
        return float("inf")
    scale = expected.float().abs().clamp(min=1.0)
    return ((got.float() - expected.float()).abs() / scale).max().item()


def _tables(lengths, block_size, num_blocks, seed, device):
    import torch

    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    width = max(1, max(-(-n // block_size) for n in lengths))
    rows = []
    for n in lengths:
        own = [free.pop() for _ in range(-(-n // block_size))]
        rows.append(own + [0] * (width - len(own)))
    return torch.tensor(rows, device=device)


def check_decode(device, dtype, heads, kv_heads, head_dim, lengths, num_splits=None):
    import torch

    from tokstream.kernels import paged_decode_attention as kernel

    block_size = 16
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = _tables(lengths, block_size, num_blocks, heads, device)
    lens = torch.tensor(lengths, device=device)
    q = torch.randn(len(lengths), heads, head_dim, device=device).to(dtype)
    out = torch.full_like(q, float("nan"))
    kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                  num_splits=num_splits, out=out)
    return _max_error(out, kernel.reference(q, k_cache, v_cache, tables, lens, head_dim ** -0.5))


def check_prefill(device, dtype, heads, kv_heads, head_dim, shapes):
    """shapes: (cached prefix, chunk) per sequence."""
    import torch

    from tokstream.kernels import paged_prefill_attention as kernel

    block_size = 16
    lengths = [p + c for p, c in shapes]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = _tables(lengths, block_size, num_blocks, head_dim, device)
    chunks = [c for _, c in shapes]
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    q = torch.randn(sum(chunks), heads, head_dim, device=device).to(dtype)
    args = (torch.tensor(starts, device=device), torch.tensor(chunks, device=device),
            torch.tensor(lengths, device=device), tables)
    out = torch.full_like(q, float("nan"))
    kernel.paged_prefill_attention(q, k_cache, v_cache, *args, head_dim ** -0.5,
                                   max_query_len=max(chunks), out=out)
    return _max_error(out, kernel.reference(q, k_cache, v_cache, *args, head_dim ** -0.5))


def check_kv_write(device, dtype, kv_heads, head_dim, num_tokens):
    import torch

    from tokstream.kernels import kv_cache_write as kernel

    block_size, num_blocks = 16, -(-num_tokens // 16) * 2 + 2
    caches = [torch.full((kv_heads, num_blocks, block_size, head_dim), 3.0,
                         device=device).to(dtype) for _ in range(4)]
    k = torch.randn(num_tokens, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::7] = -1  # padded rows
    kernel.write_kv(caches[0], caches[1], k, v, slots)
    kernel.reference(caches[2], caches[3], k, v, slots)
    return max(_max_error(caches[0], caches[2]), _max_error(caches[1], caches[3]))


def check_rms_norm(device, dtype, hidden, num_tokens):
    import torch

    from tokstream.kernels import rms_norm as kernel

    x = torch.randn(num_tokens, hidden, device=device) * 4
    delta = torch.randn(num_tokens, hidden, device=device).to(dtype)
    weight = torch.rand(hidden, device=device) + 0.5
    expected_x = x.clone()
    expected = kernel.reference(expected_x, delta, weight, 1e-5, dtype)
    out = torch.full((num_tokens, hidden), float("nan"), device=device, dtype=dtype)
    kernel.add_rms_norm(x, delta, weight, 1e-5, dtype, out=out)
    return max(_max_error(out, expected), _max_error(x, expected_x))


def check_rotary(device, dtype, heads, kv_heads, head_dim, num_tokens):
    import torch

    from tokstream.kernels import rotary as kernel
    from tokstream.kernels.torch_ops import Rotary

    rotary = Rotary(head_dim, 8192, 500000.0).to(device)
    split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    qkv = torch.randn(num_tokens, sum(split), device=device).to(dtype)
    expected = qkv.clone()
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    for buffer, apply in ((qkv, kernel.apply_rotary), (expected, kernel.reference)):
        q, k, _ = buffer.split(split, dim=-1)
        apply(q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
              positions, rotary.cos, rotary.sin)
    return _max_error(qkv, expected)


def cases(device: str):
    """(name, dtype name, function) for every kernel; serving shapes on a GPU (Llama-8B's
    32/8 heads of 128, SmolLM2's 9/3 heads of 64), small ones for the interpreter."""
    import torch

    big = device != "cpu"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    rng = random.Random(0)
    lengths = ([rng.randrange(1, 4096) for _ in range(14)] + [1, 0] if big else [1, 37, 16, 0])
    shapes = ([(0, 512), (1000, 300), (33, 1), (4000, 96)] if big else [(0, 9), (20, 5), (3, 1)])
    heads = [(32, 8, 128), (9, 3, 64)] if big else [(4, 2, 32)]
    tokens = 300 if big else 9
    found = []
    for dtype_name, dtype in dtypes.items():
        for h, kv, d in heads:
            tag = f"{dtype_name} heads {h}/{kv}x{d}"
            found.append((f"decode {tag}", dtype_name,
                          lambda dtype=dtype, h=h, kv=kv, d=d: check_decode(
                              device, dtype, h, kv, d, lengths)))
            found.append((f"decode one split {tag}", dtype_name,
                          lambda dtype=dtype, h=h, kv=kv, d=d: check_decode(
                              device, dtype, h, kv, d, lengths, num_splits=1)))
            found.append((f"prefill {tag}", dtype_name,
                          lambda dtype=dtype, h=h, kv=kv, d=d: check_prefill(
                              device, dtype, h, kv, d, shapes)))
            found.append((f"rotary {tag}", dtype_name,
                          lambda dtype=dtype, h=h, kv=kv, d=d: check_rotary(
                              device, dtype, h, kv, d, tokens)))
            found.append((f"kv write {tag}", dtype_name,
                          lambda dtype=dtype, kv=kv, d=d: check_kv_write(
                              device, dtype, kv, d, tokens)))
        found.append((f"add rms norm {dtype_name}", dtype_name,
                      lambda dtype=dtype: check_rms_norm(device, dtype, 4096 if big else 72,
                                                         tokens)))
    return found


def run(device: str) -> list[dict]:
    import torch

    torch.manual_seed(0)
    results = []
    for name, dtype_name, check in cases(device):
        try:
            error = check()
            results.append({"kernel": name, "max_error": error,
                            "tolerance": TOLERANCE[dtype_name],
                            "ok": error <= TOLERANCE[dtype_name]})
        except Exception as exc:  # reported per kernel: one failure does not hide the others
            results.append({"kernel": name, "error": f"{type(exc).__name__}: {exc}",
                            "ok": False})
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    results = run(args.device)
    for r in results:
        detail = r.get("error") or f"max error {r['max_error']:.2e} (tolerance {r['tolerance']:g})"
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['kernel']}: {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "results": results}, f, indent=2)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
