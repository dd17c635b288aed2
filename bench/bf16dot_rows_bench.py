"""The bf16dot product (kernels/cpu_bf16_matmul.c) at a git revision against the working
tree's, side by side in one run: one forward pass's decoder linears of SmolLM2's shapes (30
layers; the LM head never takes a bfloat16 copy), each weight packed by its own build, streamed
in model order from memory as a decode step reads them, at the row counts the bf16dot path
takes (the path probe gives it 12+ rows on a Zen 4).

    .venv/bin/python bench/bf16dot_rows_bench.py --base HEAD   # -> bench/results/bf16dot_rows-<kind>.json

Random weights: the cost is the bytes read and the arithmetic, not the values. Each size
alternates the two builds, best of --repeats, and the load average is recorded. Only on a CPU
with avx512_bf16 (elsewhere the kernel builds empty and is never chosen).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from kernel_at_revision import build_at, provenance, timed_row, write  # noqa: E402
from quant_rows_bench import HIDDEN, INTER, KV, LAYERS  # noqa: E402
from tokstream.kernels import cpu_bf16_dot, cpu_build, cpu_small_ops  # noqa: E402

SOURCES = ("cpu_bf16_matmul.c", "cpu_panel_runs.h", "cpu_vector_math.h")
LAYER_SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
"""(out, in) of a layer's products as the model holds them: q/k/v and gate/up fused."""
_P, _I = ctypes.c_void_p, ctypes.c_int64


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.bf16_pack_weight.argtypes = [_P, _I, _I, _P]
    lib.bf16_pack_rows.argtypes = [_P, _I, _I, _P]
    lib.bf16_matmul.argtypes = [_P, _I, _P, _I, _I, _P]
    if hasattr(lib, "bf16_matmul_silu"):
        lib.bf16_matmul_silu.argtypes = [_P, _I, _P, _I, _I, _P]
    return lib


def packed(lib, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    pairs = torch.empty(n * k // 2, dtype=torch.int32)
    lib.bf16_pack_weight(weight.data_ptr(), n, k, pairs.data_ptr())
    return pairs


def pass_time(lib, weights, rows, m: int, repeats: int, entry: str = "bf16_matmul") -> float:
    calls = [(rows[k].data_ptr(), m, pairs.data_ptr(), n, k, out.data_ptr())
             for pairs, n, k, out in weights]
    product = getattr(lib, entry)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            product(*call)
        best = min(best, time.perf_counter() - start)
    return best


def separate_products(lib, packs, shapes, rows, m: int, args, fused_s: float,
                      fused_outs) -> dict:
    """The tree's gate/up products as the two steps SiLU in the product replaced: each
    product written out (bf16_matmul), then silu_mul reading it back; best of as many rounds
    as the fused timing had, and whether the outputs are the fused ones bit for bit."""
    wide = [torch.empty(m, o) for o, _ in shapes]
    narrow = [torch.empty(m, o // 2) for o, _ in shapes]
    silu = cpu_small_ops.load().silu_mul
    best = float("inf")
    for _ in range(args.rounds * args.repeats):
        start = time.perf_counter()
        for pairs, (o, i), out, act in zip(packs, shapes, wide, narrow):
            lib.bf16_matmul(rows[i].data_ptr(), m, pairs.data_ptr(), o, i, out.data_ptr())
            silu(out.data_ptr(), m, o // 2, act.data_ptr())
        best = min(best, time.perf_counter() - start)
    return {"tree_separate_ms": round(best * 1e3, 3),
            "tree_over_separate": round(fused_s / best, 3),
            "separate_outputs_equal": all(torch.equal(a, b) for a, b in zip(narrow, fused_outs))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--rows", default="8,12,16,24,32,48,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two builds")
    p.add_argument("--gate-up-silu", action="store_true",
                   help="the 30 gate/up products with SiLU applied in them (bf16_matmul_silu) "
                        "instead of every decoder product; the base must have it too")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not cpu_bf16_dot.available():
        raise SystemExit("this CPU has no avx512_bf16: the bf16dot path is never chosen here")
    generator = torch.Generator().manual_seed(0)
    layer_shapes = [(2 * INTER, HIDDEN)] if args.gate_up_silu else LAYER_SHAPES
    entry = "bf16_matmul_silu" if args.gate_up_silu else "bf16_matmul"
    width = 2 if args.gate_up_silu else 1  # outputs a row: SiLU(gate) * up is half of [gate; up]
    shapes = [(o, i) for _ in range(LAYERS) for o, i in layer_shapes]
    weights = [torch.randn(o, i, generator=generator) * 0.05 for o, i in shapes]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": bind(build_at(args.base, Path(tmp), SOURCES, cpu_bf16_dot.FLAGS)),
                "tree": bind(cpu_build.build(cpu_bf16_dot.SOURCE, cpu_bf16_dot.FLAGS))}
        packs = {name: [packed(lib, w) for w in weights] for name, lib in libs.items()}
        results = []
        for m in [int(r) for r in args.rows.split(",")]:
            rows = {}
            for k in (HIDDEN, INTER):
                x = torch.randn(m, k, generator=generator)
                rows[k] = torch.empty(m * k // 2, dtype=torch.int32)
                libs["tree"].bf16_pack_rows(x.data_ptr(), m, k, rows[k].data_ptr())
            times = {"base": float("inf"), "tree": float("inf")}
            outs = {}
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    passed = [(pairs, o, i, torch.empty(m, o // width))
                              for pairs, (o, i) in zip(packs[name], shapes)]
                    times[name] = min(times[name],
                                      pass_time(lib, passed, rows, m, args.repeats, entry))
                    outs[name] = [w[3] for w in passed]
            same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"]))
            row = timed_row({"rows": m}, times, outputs_equal=same)
            if args.gate_up_silu:
                row.update(separate_products(libs["tree"], packs["tree"], shapes, rows, m,
                                             args, times["tree"], outs["tree"]))
            results.append(row)
    write({"bench": "bf16dot_rows_bench", **provenance(args.base), "products": entry,
           "results": results}, args.out)


if __name__ == "__main__":
    main()
