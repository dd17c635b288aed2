"""Matrix products straight from GGUF-quantised weights on CPU (cpu_quant_matmul.c), compiled
on first use and called through ctypes with raw tensor pointers.

A weight is its GGUF bytes as a (N, K / 32 * block_bytes) uint8 tensor, rows in output order.
`matmul` dequantises each weight row into an L1-sized buffer and applies it to every input
row at once, so the weights are read once per call at their quantised size (Q4_1: 5 bits a
weight instead of 32). `dequantize` writes the float32 weight out, for products with many
input rows where a float matrix product over it wins (the caller measures where that is).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokstream.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_quant_matmul.c")
# Contraction off: a dequantised weight is then the very float ggml's reference produces.
FLAGS = (*cpu_build.BASE_FLAGS, "-std=gnu11", "-ffp-contract=off")
BLOCK = 32
"""Weights per quantisation block, for every supported type."""
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
"""ggml type ids of the formats the kernel reads."""
FLOAT_SCALES = 100
"""Added to a type id: the same blocks with float32 scales (with_float_scales)."""
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 102: 20, 103: 24, 108: 36}
_SCALES = {2: 1, 3: 2, 8: 1}
"""float16 scales at the head of each block: d, or d and m (Q4_1)."""
_P, _I = ctypes.c_void_p, ctypes.c_int64
_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {
    "quant_matmul": [_I, _P, _I, _I, _P, _I, _P, _P],
    "quant_dequantize": [_I, _P, _I, _I, _P],
    "quant_scratch_floats": ([_I], _I),
    "quant_vector_lanes": ([], ctypes.c_int)})
_scratch: torch.Tensor | None = None


def load() -> ctypes.CDLL | None:
    """The compiled library, built once per machine; None if unavailable."""
    return _LIBRARY.load()


def with_float_scales(blocks, qtype: int):
    """(N, row bytes) uint8 numpy blocks of a ggml type -> the same blocks with their float16
    scales widened to float32 (exact), and the new type id. The kernel then broadcasts each
    scale straight from memory (measured: the decode products' bottleneck was converting
    float16 scales, one or two per 32 weights); the weights stay 4 or 8 bits."""
    import numpy as np

    if qtype not in _SCALES:
        raise ValueError(f"no float-scale form of type {qtype}")
    n, row_bytes = blocks.shape
    nb = row_bytes // BLOCK_BYTES[qtype]
    raw = blocks.reshape(n, nb, BLOCK_BYTES[qtype])
    k = _SCALES[qtype]
    scales = np.ascontiguousarray(raw[:, :, :2 * k]).view(np.float16).astype(np.float32)
    out = np.empty((n, nb, BLOCK_BYTES[qtype + FLOAT_SCALES]), dtype=np.uint8)
    out[:, :, :4 * k] = scales.view(np.uint8).reshape(n, nb, 4 * k)
    out[:, :, 4 * k:] = raw[:, :, 2 * k:]
    return out.reshape(n, -1), qtype + FLOAT_SCALES


def scratch_floats(k: int) -> int:
    """Floats of scratch `matmul` needs for k inputs (a few weight rows per thread)."""
    return load().quant_scratch_floats(k)


def available() -> bool:
    return load() is not None


def _check(weight: torch.Tensor, qtype: int, k: int) -> int:
    if qtype not in BLOCK_BYTES or k % BLOCK:
        raise ValueError(f"unsupported quantised weight: type {qtype}, {k} inputs")
    if weight.dtype != torch.uint8 or not weight.is_contiguous() or weight.dim() != 2 \
            or weight.shape[1] != k // BLOCK * BLOCK_BYTES[qtype]:
        raise ValueError(f"weight must be contiguous uint8 (N, {k // BLOCK * BLOCK_BYTES[qtype]})")
    return weight.shape[0]


def input_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """A product's inputs, contiguous, checked to be (M, k) float32 (what every kernel of
    these products reads)."""
    x = x.contiguous()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 (M, {k}), got {x.dtype} {tuple(x.shape)}")
    return x


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int, k: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32 @ dequantised(weight)^T -> (M, N) float32."""
    global _scratch
    n = _check(weight, qtype, k)
    x = input_rows(x, k)
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out  # nothing to multiply (a step that samples no row); x has no data pointer
    needed = scratch_floats(k)
    if _scratch is None or _scratch.numel() < needed:
        _scratch = torch.empty(needed, dtype=torch.float32)
    load().quant_matmul(qtype, weight.data_ptr(), n, k, x.data_ptr(), m, out.data_ptr(),
                        _scratch.data_ptr())
    return out


def dequantize(weight: torch.Tensor, qtype: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """(N, K) float32, each weight exactly ggml's dequantised value."""
    n = _check(weight, qtype, k)
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32)
    load().quant_dequantize(qtype, weight.data_ptr(), n, k, out.data_ptr())
    return out
