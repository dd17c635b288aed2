"""The int16 product (kernels/cpu_int16_matmul.c) at a git revision against the working
tree's, side by side in one run: one forward pass's linears of SmolLM2's shapes (30 layers of
Q4_1, then the Q8_0 LM head), each weight packed by its own build, streamed in model order as
a decode step reads them, at 1-32 input rows.

    .venv/bin/python bench/int16_rows_bench.py --base HEAD   # -> bench/results/int16_rows-<kind>.json

Random blocks (valid float16 scales): the cost is the bytes read and the arithmetic, not the
values. Each size alternates the two builds, best of --repeats, and the load average is
recorded. The inputs are rounded once per size (the stack rounds each input once too).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from kernel_at_revision import build_at, provenance, timed_row, write  # noqa: E402
from quant_rows_bench import (HIDDEN, INTER, LAYER_SHAPES, LAYERS, VOCAB,  # noqa: E402
                              random_blocks)
from tokstream.kernels import cpu_build, cpu_int16  # noqa: E402

SOURCES = ("cpu_int16_matmul.c", "cpu_vector_math.h", "cpu_panel_runs.h")


def packed(lib, blocks: torch.Tensor, qtype: int, n: int, k: int):
    """(quants, scales, offsets, bits) as this build packs them."""
    lib.i16_scale_bytes.restype = ctypes.c_int64
    lib.i16_quant_bits.restype = ctypes.c_int64
    bits = lib.i16_quant_bits(ctypes.c_int64(qtype))
    dtype = torch.float16 if lib.i16_scale_bytes() == 2 else torch.float32
    quants = torch.empty(n * k * bits // 8, dtype=torch.int8)
    scales = torch.empty(n * k // 32, dtype=dtype)
    offsets = torch.empty_like(scales) if qtype in cpu_int16.WITH_OFFSETS else None
    ok = lib.i16_pack(ctypes.c_int64(qtype), ctypes.c_void_p(blocks.data_ptr()),
                      ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_void_p(quants.data_ptr()),
                      ctypes.c_void_p(scales.data_ptr()),
                      ctypes.c_void_p(offsets.data_ptr() if offsets is not None else None))
    if not ok:
        raise SystemExit("a weight did not pack")
    return quants, scales, offsets, bits


def rounded(lib, x: torch.Tensor):
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int16)
    sx, sums = torch.empty(m, k // 32), torch.empty(m, k // 32)
    lib.i16_quantize_rows(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(m), ctypes.c_int64(k),
                          ctypes.c_void_p(xq.data_ptr()), ctypes.c_void_p(sx.data_ptr()),
                          ctypes.c_void_p(sums.data_ptr()))
    return xq, sx, sums


def pass_time(lib, weights, inputs, m: int, repeats: int) -> float:
    fn = lib.i16_matmul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    calls = []
    for (quants, scales, offsets, bits), n, k, out in weights:
        xq, sx, sums = inputs[k]
        calls.append((xq.data_ptr(), sx.data_ptr(), sums.data_ptr() if offsets is not None
                      else None, m, quants.data_ptr(), scales.data_ptr(),
                      offsets.data_ptr() if offsets is not None else None, n, k, bits,
                      out.data_ptr()))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            fn(*call)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two builds")
    p.add_argument("--cflags", default="",
                   help="extra compiler flags for both builds, e.g. -mno-avx512f (the AVX2 path)")
    p.add_argument("--base-without", default="",
                   help="flags of cpu_int16.FLAGS the base build leaves out (compares compiler "
                        "flags on one source: --base HEAD --base-without '-fschedule-insns')")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    flags = (*cpu_int16.FLAGS, *args.cflags.split())
    left_out = set(args.base_without.split())
    rng = np.random.default_rng(0)
    shapes = [(o, i, 3) for _ in range(LAYERS) for o, i in LAYER_SHAPES] + [(VOCAB, HIDDEN, 8)]
    blocks = {s: random_blocks(*s, rng) for s in set(shapes)}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_at(args.base, Path(tmp), SOURCES,
                                 tuple(f for f in flags if f not in left_out)),
                "tree": cpu_build.build(cpu_int16.SOURCE, flags)}
        packs = {name: {s: packed(lib, blocks[s][0], blocks[s][1], s[0], s[1])
                        for s in blocks} for name, lib in libs.items()}
        results = []
        for m in [int(r) for r in args.rows.split(",")]:
            x = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
            times = {"base": float("inf"), "tree": float("inf")}
            outs = {}
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    inputs = {k: rounded(lib, v) for k, v in x.items()}
                    weights = [(packs[name][s], s[0], s[1], torch.empty(m, s[0]))
                               for s in shapes]
                    times[name] = min(times[name],
                                      pass_time(lib, weights, inputs, m, args.repeats))
                    outs[name] = [w[3].clone() for w in weights[-8:]]
            same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"]))
            results.append(timed_row({"rows": m}, times, outputs_equal=same))
    doc = {"bench": "int16_rows_bench", **provenance(args.base), "cflags": args.cflags,
           "base_without": args.base_without,
           "vector_lanes": libs["tree"].i16_vector_lanes(), "results": results}
    write(doc, args.out)


if __name__ == "__main__":
    main()
