"""The decode-attention kernel (kernels/cpu_paged_attention.c) at a git revision against the
working tree's, side by side in one run: one decode step's attention over SmolLM2's 30 layers
(9 query heads, 3 kv heads, head_dim 64, block size 16) for a batch of sequences, each layer
with its own pool and blocks scattered as a served pool's are, so a pass reads the caches
cold from memory as a step does (its 30 layers' caches are far larger than the caches).

    .venv/bin/python bench/attention_bench.py --base HEAD   # -> bench/results/attention-<kind>.json

Each batch size alternates the two builds, best of --repeats, and records the load average.
"""

from __future__ import annotations

import argparse
import os
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
from tokstream.kernels import cpu_attention, cpu_build  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
SOURCES = ("cpu_paged_attention.c", "cpu_bf16.h", "cpu_vector_math.h", "cpu_panel_runs.h")
KERNELS = {"float16": "paged_decode_attention_f16kv", "float32": "paged_decode_attention_f32"}


def step_time(lib, kernel: str, layers, q, tables, lens, scratch, repeats: int):
    fn = getattr(lib, kernel)
    fn.argtypes = cpu_attention._SIGNATURE
    seqs = q.shape[0]
    best = float("inf")
    outs = []
    for _ in range(repeats):
        outs = []
        start = time.perf_counter()
        for k, v in layers:
            out = torch.empty_like(q)
            fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
               out.data_ptr(), HEADS, KV_HEADS, HEAD_DIM, k.shape[1], k.shape[2], tables.shape[1],
               HEAD_DIM ** -0.5, 0, seqs, scratch.data_ptr())
            outs.append(out)
        best = min(best, time.perf_counter() - start)
    return best, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=192, help="mean cached tokens a sequence")
    p.add_argument("--cache", default="float16", choices=sorted(KERNELS))
    p.add_argument("--block-size", type=int, default=16, help="positions a block (serve's 16)")
    p.add_argument("--contiguous", action="store_true",
                   help="each sequence's blocks one after another (a served pool scatters them)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hot", action="store_true",
                   help="every layer reads the first layer's pool (in the caches): the floor")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.cache)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_at(args.base, Path(tmp), SOURCES, cpu_attention.FLAGS),
                "tree": cpu_build.build(cpu_attention.SOURCE, cpu_attention.FLAGS)}
        results = []
        for seqs in [int(b) for b in args.batches.split(",")]:
            lens = torch.randint(args.context // 2, args.context * 3 // 2 + 1, (seqs,),
                                 generator=gen)
            max_blocks = int(lens.max()) // args.block_size + 1
            blocks = seqs * max_blocks + 64
            order = (torch.arange(blocks) if args.contiguous
                     else torch.randperm(blocks, generator=gen))
            tables = order[:seqs * max_blocks]
            tables = tables.reshape(seqs, max_blocks).contiguous()
            shape = (KV_HEADS, blocks, args.block_size, HEAD_DIM)
            layers = [(torch.randn(shape, generator=gen).to(dtype),
                       torch.randn(shape, generator=gen).to(dtype))
                      for _ in range(1 if args.hot else LAYERS)]
            layers = layers * (LAYERS // len(layers))
            q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen)
            scratch = torch.empty(torch.get_num_threads() * 3
                                  * (max_blocks * args.block_size + 128))
            times = {"base": float("inf"), "tree": float("inf")}
            outs = {}
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    t, outs[name] = step_time(lib, KERNELS[args.cache], layers, q, tables, lens,
                                              scratch, args.repeats)
                    times[name] = min(times[name], t)
            close = all(torch.allclose(a, b, atol=1e-5, rtol=1e-4)
                        for a, b in zip(outs["base"], outs["tree"]))
            results.append(timed_row({"seqs": seqs, "mean_context": float(lens.float().mean())},
                                     times, outputs_close=close))
    doc = {"bench": "attention_bench", **provenance(args.base), "cache": args.cache,
           "hot": args.hot, "block_size": args.block_size, "contiguous": args.contiguous,
           "transparent_huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
           "results": results}
    write(doc, args.out)


if __name__ == "__main__":
    main()
