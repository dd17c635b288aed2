"""Decode attention over a CPU KV pool in private huge-page memory (the pool a rank allocates
for itself) and in a shared memory file (the pool that outlives its rank:
engine/recovery/pool_files.py), whose pages are 4 KiB where shmem THP is off (the JSON records
the kernel's shmem_enabled). Alternated, repeated; ratios, not absolutes.

    .venv/bin/python bench/kv_pool_pages.py --json bench/results/kv_pool_pages.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recovery_timing import machine  # noqa: E402
from tokstream.engine.recovery.pool_files import PoolFiles  # noqa: E402
from tokstream.kernels import cpu_attention  # noqa: E402
from tokstream.worker.shared_pool import carve, map_pool_file, pool_bytes  # noqa: E402
from tokstream.worker.zeroed_memory import lazily_zeroed  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M at --tp 1
LAYERS = 30


def pools(kind: str, num_blocks: int, files: PoolFiles,
          dtype: torch.dtype) -> list[torch.Tensor]:
    shape = (KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    if kind == "private":
        tensors = [lazily_zeroed(shape, dtype) for _ in range(2 * LAYERS)]
    else:
        nbytes = pool_bytes(2 * LAYERS, shape, dtype)
        tensors = carve(map_pool_file(files.paths().ranks[0], nbytes), 2 * LAYERS, shape,
                        dtype)
    for tensor in tensors:
        tensor.normal_()
    return tensors


def shmem_setting() -> str | None:
    """The kernel's shmem huge page setting (the bracketed word), which decides the shared
    pool's page size; None where it cannot be read."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--pool-mib", type=int, default=1300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-dtype", choices=("float16", "float32"), default="float16",
                        help="the cache's dtype (float16: the default cache under float32)")
    parser.add_argument("--placement", choices=("random", "served"), default="random",
                        help="served: each sequence's prompt blocks (--prompt tokens) in one "
                             "run, then the decode blocks interleaved across sequences, as a "
                             "fresh pool hands them out to a burst of requests")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    torch.manual_seed(0)
    dtype = getattr(torch, args.kv_dtype)
    element = torch.empty((), dtype=dtype).element_size()
    num_blocks = args.pool_mib * 2**20 // (2 * LAYERS * KV_HEADS * BLOCK * HEAD_DIM * element)
    per_seq = -(-args.context // BLOCK)
    if args.placement == "random":
        tables = torch.randperm(num_blocks)[:args.seqs * per_seq].view(args.seqs, per_seq)
    else:
        prompt = -(-args.prompt // BLOCK)
        tables = torch.tensor([[i * prompt + j if j < prompt
                                else args.seqs * prompt + (j - prompt) * args.seqs + i
                                for j in range(per_seq)] for i in range(args.seqs)])
    lens = torch.full((args.seqs,), args.context, dtype=torch.int64)
    q = torch.randn(args.seqs, HEADS, HEAD_DIM)
    times: dict[str, list[float]] = {"private": [], "shared": []}
    for _ in range(args.rounds):
        for kind in times:
            files = PoolFiles(1)
            tensors = pools(kind, num_blocks, files, dtype)
            layers = list(zip(tensors[0::2], tensors[1::2]))
            for k, v in layers:  # warm
                cpu_attention.paged_decode_attention(q, k, v, tables.contiguous(), lens, 0.125)
            started = time.perf_counter()
            for _ in range(10):
                for k, v in layers:
                    cpu_attention.paged_decode_attention(q, k, v, tables.contiguous(), lens,
                                                         0.125)
            times[kind].append(round((time.perf_counter() - started) / 10 * 1000, 2))
            del tensors, layers
            files.close()
    result = {"what": "ms per decode step of attention over all layers", "args": vars(args),
              "shmem_enabled": shmem_setting(),
              "machine": machine(), "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "ms": times,
              "shared_over_private": round(statistics.median(times["shared"])
                                           / statistics.median(times["private"]), 3)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
