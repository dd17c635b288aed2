"""The prefill-attention kernel (kernels/cpu_prefill_attention.c) at a git revision against the
working tree's, side by side in one run: one prefill step's attention over SmolLM2's 30 layers
(9 query heads, 3 kv heads, head_dim 64, block size 16, a float16 cache under float32 queries),
each layer with its own pool and blocks scattered as a served pool's are.

    .venv/bin/python bench/prefill_attention_bench.py --base HEAD
    # -> bench/results/prefill_attention-<cpu kind>.json

A revision whose library takes one chunk a call (its ABI before the batched entry) is driven as
tokstream's worker drove it: a call per chunk and layer, each chunk's queries made contiguous
and its output copied into the step's; the tree's takes all of a step's chunks in one call a
layer, as the worker now does. Each step shape alternates the two builds, best of --repeats,
and records the load average.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from worker_env import as_a_rank  # noqa: E402

if __name__ == "__main__":
    as_a_rank()

import torch  # noqa: E402

from kernel_at_revision import build_at, provenance, timed_row, write  # noqa: E402
from tokstream.kernels import cpu_prefill_attention as kernel  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SOURCES = ("cpu_prefill_attention.c", "cpu_bf16.h", "cpu_vector_math.h")
STEPS = {"16x128": [(128, 128)] * 16, "4x512": [(512, 512)] * 4,
         "1x512_at_2048": [(512, 2048)], "1x2048": [(2048, 2048)]}
"""Step shapes: (query_len, context_len) of each chunk."""
PER_CHUNK = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_float,
                                                                           ctypes.c_void_p]
"""The one-chunk entry's arguments (before the batched one)."""


def per_chunk_step(lib, layers, qkv, chunks, tables, scratch):
    """A revision with the one-chunk entry, called as the worker called it."""
    fn = lib.paged_prefill_attention
    fn.argtypes = PER_CHUNK
    outs = []
    for k, v in layers:
        q = qkv[:, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        out = torch.empty(q.shape, dtype=q.dtype)
        for (start, query_len, context), table in zip(chunks, tables):
            chunk = q[start:start + query_len].contiguous()
            part = torch.empty_like(chunk)
            fn(chunk.data_ptr(), 0, k.data_ptr(), v.data_ptr(), 2, table.data_ptr(),
               part.data_ptr(), query_len, context, HEADS, KV_HEADS, HEAD_DIM, k.shape[1], BLOCK,
               HEAD_DIM ** -0.5, scratch.data_ptr())
            out[start:start + query_len] = part
        outs.append(out)
    return outs


def batched_step(lib, layers, qkv, chunks, tables, scratch):
    """The tree's batched entry, one call a layer (through the module, as the worker calls it)."""
    rows = torch.tensor(chunks, dtype=torch.int64)
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    outs = []
    for k, v in layers:
        q = qkv[:, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        outs.append(kernel.paged_prefill_attention_batch(q, k, v, padded, rows, HEAD_DIM ** -0.5))
    return outs


def best(step, repeats, *args):
    top, outs = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        outs = step(*args)
        top = min(top, time.perf_counter() - started)
    return top, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD")
    p.add_argument("--steps", default=",".join(STEPS), help=f"of {', '.join(STEPS)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_at(args.base, Path(tmp), SOURCES, kernel.FLAGS)
        if hasattr(base, "prefill_packed_floats"):
            raise SystemExit(f"{args.base} already has the batched entry: this bench times the "
                             "one-chunk entry against it")
        results = []
        for name in args.steps.split(","):
            shape = STEPS[name]
            starts = [sum(q for q, _ in shape[:i]) for i in range(len(shape))]
            chunks = [(s, q, c) for s, (q, c) in zip(starts, shape)]
            blocks_each = [-(-c // BLOCK) for _, c in shape]
            pool = sum(blocks_each) + 64
            order = torch.randperm(pool, generator=gen)
            tables, at = [], 0
            for n in blocks_each:
                tables.append(order[at:at + n].contiguous())
                at += n
            cache = (KV_HEADS, pool, BLOCK, HEAD_DIM)
            layers = [tuple(torch.randn(cache, generator=gen).half() for _ in range(2))
                      for _ in range(LAYERS)]
            qkv = torch.randn(sum(q for q, _ in shape), (HEADS + 2 * KV_HEADS) * HEAD_DIM,
                              generator=gen)
            scratch = torch.empty(2 * KV_HEADS * (max(c for _, c in shape) + 64) * HEAD_DIM
                                  + torch.get_num_threads() * 64 * 1024)
            steps = {"base": (per_chunk_step, base), "tree": (batched_step, None)}
            times, outs = {"base": float("inf"), "tree": float("inf")}, {}
            for _ in range(args.rounds):
                for side, (step, lib) in steps.items():
                    t, outs[side] = best(step, args.repeats, lib, layers, qkv, chunks, tables,
                                         scratch)
                    times[side] = min(times[side], t)
            close = all(torch.allclose(a, b, atol=2e-6, rtol=0)
                        for a, b in zip(outs["base"], outs["tree"]))
            flops = sum(4 * HEADS * HEAD_DIM * (q * (c - q) + q * (q + 1) / 2)
                        for _, q, c in chunks) * LAYERS
            results.append(timed_row({"step": name, "chunks": len(chunks),
                                      "tree_gflops": round(flops / times["tree"] / 1e9, 1)},
                                     times, outputs_close=close))
    doc = {"bench": "prefill_attention_bench", **provenance(args.base), "cache": "float16",
           "queries": "float32", "layers": LAYERS, "results": results}
    write(doc, args.out)


if __name__ == "__main__":
    main()
