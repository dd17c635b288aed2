"""Products over a bfloat16 copy of a weight by AVX-512 BF16 dot products (cpu_bf16_matmul.c),
for the decode steps of a batch inside the one-call decode stack: the same rounding as torch's
bfloat16 linears (inputs and weights to bfloat16, float32 sums), with the outputs handed to
the threads on demand. Only on a CPU with avx512_bf16 (`available`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tokstream.kernels import cpu_build, cpu_quant

SOURCE = Path(__file__).with_name("cpu_bf16_matmul.c")
FLAGS = (*cpu_build.BASE_FLAGS, "-std=gnu11")
LANES = 16
_P, _I = ctypes.c_void_p, ctypes.c_int64

_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {
    "bf16_pack_weight": [_P, _I, _I, _P],
    "bf16_pack_rows": [_P, _I, _I, _P],
    "bf16_matmul": [_P, _I, _P, _I, _I, _P],
    "bf16_matmul_silu": [_P, _I, _P, _I, _I, _P],
    "bf16_matmul_available": ([], ctypes.c_int)})


def load() -> ctypes.CDLL | None:
    """The compiled library, built once per machine; None if unavailable."""
    return _LIBRARY.load()


def available() -> bool:
    """The products can run here: the library built with AVX-512 BF16."""
    library = load()
    return library is not None and bool(library.bf16_matmul_available())


@dataclass
class Bf16DotWeight:
    """One weight as bf16_matmul reads it (layout in cpu_bf16_matmul.c)."""

    pairs: torch.Tensor
    """(N * K / 2,) int32: 16 output rows and 2 inputs a vector, each a bfloat16 pair."""
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return self.pairs.numel() * 4


def pack(weight: torch.Tensor) -> Bf16DotWeight | None:
    """A float32 (N, K) matrix packed; None where the shape does not fit (N a multiple of 16,
    K of 2) or the products cannot run here."""
    n, k = weight.shape
    if not available() or n % LANES or k % 2:
        return None
    weight = weight.to(torch.float32).contiguous()
    pairs = torch.empty(n * k // 2, dtype=torch.int32)
    load().bf16_pack_weight(weight.data_ptr(), n, k, pairs.data_ptr())
    return Bf16DotWeight(pairs, n, k)


def matmul(x: torch.Tensor, weight: Bf16DotWeight) -> torch.Tensor:
    """x (M, K) float32 @ weight^T -> (M, N) float32, x rounded to bfloat16."""
    return _product(x, weight, weight.out_features, "bf16_matmul")


def matmul_silu(x: torch.Tensor, weight: Bf16DotWeight) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) -> (M, N / 2) float32 for a [gate; up] weight of N rows
    (N / 2 a multiple of 16): the bits of matmul then cpu_small_ops.silu_mul, without the
    (M, N) product between them."""
    if weight.out_features % (2 * LANES):
        raise ValueError(f"a [gate; up] weight of {weight.out_features} rows has no halves "
                         f"of whole {LANES}-row groups")
    return _product(x, weight, weight.out_features // 2, "bf16_matmul_silu")


def _product(x: torch.Tensor, weight: Bf16DotWeight, width: int, entry: str) -> torch.Tensor:
    k = weight.in_features
    x = cpu_quant.input_rows(x, k)
    m = x.shape[0]
    out = torch.empty(m, width)
    if m == 0:
        return out
    library = load()
    rows = torch.empty(m * k // 2, dtype=torch.int32)
    library.bf16_pack_rows(x.data_ptr(), m, k, rows.data_ptr())
    getattr(library, entry)(rows.data_ptr(), m, weight.pairs.data_ptr(), weight.out_features,
                            k, out.data_ptr())
    return out
