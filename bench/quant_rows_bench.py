"""The fused quantised matmul (kernels/cpu_quant_matmul.c) at a git revision against the
working tree's, side by side in one run: one forward pass's linears of SmolLM2's shapes
(30 layers of Q4_1 with float scales, then the Q8_0 LM head), streamed in model order as a
decode step reads them, at 1-12 input rows (a decode step's batch, or a verification chunk
of 1 + k drafted tokens).

    .venv/bin/python bench/quant_rows_bench.py --base HEAD   # -> bench/results/quant_rows-<kind>.json

Random blocks (valid scales): the cost is the bytes read and the arithmetic, not the values.
Each size alternates the two builds, best of --repeats, and the load average is recorded.
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
from tokstream.kernels import cpu_build, cpu_quant  # noqa: E402

SOURCES = ("cpu_quant_matmul.c", "cpu_vector_math.h")
HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
                (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
"""(out, in) of q, k, v, o, gate, up, down."""


def random_blocks(out: int, inp: int, qtype: int, rng) -> torch.Tensor:
    nb, size = inp // 32, cpu_quant.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(out, nb, size), dtype=np.uint8)
    scales = (rng.random((out, nb, 2)) * 0.02).astype(np.float16).view(np.uint8)
    raw[:, :, :4 if qtype == 3 else 2] = scales.reshape(out, nb, 4)[:, :, :4 if qtype == 3 else 2]
    blocks, qt = cpu_quant.with_float_scales(raw.reshape(out, nb * size), qtype)
    return torch.from_numpy(blocks), qt


def pass_time(lib, weights, x_by_in, scratch, repeats: int) -> float:
    fn = lib.quant_matmul
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for data, qtype, out_f, in_f, out in weights:
            x = x_by_in[in_f]
            fn(qtype, data.data_ptr(), out_f, in_f, x.data_ptr(), x.shape[0], out.data_ptr(),
               scratch.data_ptr())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,12")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cflags", default="",
                   help="extra compiler flags for both builds, e.g. -mno-avx512f (the AVX2 path)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    flags = (*cpu_quant.FLAGS, *args.cflags.split())
    rng = np.random.default_rng(0)
    shapes = [(o, i, 3) for _ in range(LAYERS) for o, i in LAYER_SHAPES] + [(VOCAB, HIDDEN, 8)]
    made = {}
    for o, i, qt in set(shapes):
        made[(o, i, qt)] = random_blocks(o, i, qt, rng)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_at(args.base, Path(tmp), SOURCES, flags),
                "tree": cpu_build.build(cpu_quant.SOURCE, flags)}
        scratch = torch.empty(cpu_quant.load().quant_scratch_floats(INTER) + 16)
        results = []
        for m in [int(r) for r in args.rows.split(",")]:
            x_by_in = {i: torch.randn(m, i) for i in (HIDDEN, INTER)}
            weights = [(made[s][0], made[s][1], s[0], s[1], torch.empty(m, s[0]))
                       for s in shapes]
            outs = {}
            times = {"base": float("inf"), "tree": float("inf")}
            for _ in range(2):  # alternate the builds
                for name, lib in libs.items():
                    times[name] = min(times[name], pass_time(lib, weights, x_by_in, scratch,
                                                             args.repeats))
                    outs[name] = [w[4].clone() for w in weights[-8:]]
            same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-3)
                       for a, b in zip(outs["base"], outs["tree"]))
            results.append(timed_row({"rows": m}, times, outputs_close=same))
    doc = {"bench": "quant_rows_bench", **provenance(args.base), "cflags": args.cflags,
           "vector_lanes": libs["tree"].quant_vector_lanes(), "results": results}
    write(doc, args.out)


if __name__ == "__main__":
    main()
