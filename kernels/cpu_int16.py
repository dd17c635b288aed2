"""Matrix products from GGUF-quantised weights in 16-bit integers (cpu_int16_matmul.c), for
products of any number of input rows: each weight repacked once as its file's 4- or 8-bit
quants with a scale (and offset) per 32, float16 on the vector builds (scale_dtype), each
input row rounded to int16 per block of 32, and the sums taken with vpmaddwd (AVX-512 VNNI's
vpdpwssd where there is one). The quants are widened in registers for few rows, a panel at a
time for more. Compiled on first use and called through ctypes, like cpu_quant.

Whether it is used for a weight, and from how many rows, is measured (path_choice), never
assumed; its accuracy (first-step logits within 0.009 of float32 on SmolLM2) is tested.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tokstream.kernels import cpu_build, cpu_quant

SOURCE = Path(__file__).with_name("cpu_int16_matmul.c")
FLAGS = (*cpu_build.BASE_FLAGS, "-std=gnu11")
LANES = 16
"""Output rows packed together: N must be a multiple."""
BLOCK = 32
PACKABLE = (102, 103, 108)
"""The float-scale GGUF forms (cpu_quant: Q4_0, Q4_1, Q8_0 + FLOAT_SCALES) it repacks; the
file's own forms are widened to them first."""
WITH_OFFSETS = (102, 103)
"""Formats packed with an offset per block besides the scale d: Q4_1's m (w = d q + m) and
Q4_0's -8 d (its quants kept unsigned, w = d q - 8 d)."""
NIBBLES = (102, 103)
"""Formats whose quants are packed 4 bits each (the rest take a byte)."""
_P, _I = ctypes.c_void_p, ctypes.c_int64
_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {
    "i16_pack": ([_I, _P, _I, _I, _P, _P, _P], ctypes.c_int),
    "i16_quantize_rows": [_P, _I, _I, _P, _P, _P],
    "i16_matmul": ([_P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _P], ctypes.c_int),
    "i16_quant_bits": ([_I], ctypes.c_int64),
    "i16_vector_lanes": ([], ctypes.c_int),
    "i16_scale_bytes": ([], ctypes.c_int64)})


def load() -> ctypes.CDLL | None:
    """The compiled library, built once per machine; None if unavailable."""
    return _LIBRARY.load()


@dataclass
class Int16Weight:
    """One weight repacked for i16_matmul (layouts in cpu_int16_matmul.c)."""

    quants: torch.Tensor
    """(N * K * bits / 8,) int8, 16 output rows and 2 inputs a vector (widened to int16 in the
    kernel)."""
    scales: torch.Tensor
    """(N * K / 32,) float32, or float16 where the build keeps them so (scale_dtype)."""
    offsets: torch.Tensor | None
    """(N * K / 32,) as scales, for Q4_0 and Q4_1, else None."""
    out_features: int
    in_features: int
    bits: int = 8
    """Bits a quant takes in `quants` (4 for Q4_0 and Q4_1)."""

    def nbytes(self) -> int:
        parts = (self.quants, self.scales, self.offsets)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)


def pack(blocks: torch.Tensor, qtype: int, in_features: int) -> Int16Weight | None:
    """The (N, row bytes) uint8 GGUF blocks repacked; None where the format or shape is not
    supported or the kernel is unavailable (callers keep their other paths)."""
    library = load()
    n = blocks.shape[0]
    if qtype + cpu_quant.FLOAT_SCALES in PACKABLE:
        widened, qtype = cpu_quant.with_float_scales(blocks.numpy(), qtype)
        blocks = torch.from_numpy(widened)
    if library is None or qtype not in PACKABLE or n % LANES or in_features % BLOCK:
        return None
    bits = quant_bits(qtype)
    quants = torch.empty(n * in_features * bits // 8, dtype=torch.int8)
    scales = torch.empty(n * in_features // BLOCK, dtype=scale_dtype())
    offsets = torch.empty_like(scales) if qtype in WITH_OFFSETS else None
    blocks = blocks.contiguous()
    if not library.i16_pack(qtype, blocks.data_ptr(), n, in_features, quants.data_ptr(),
                            scales.data_ptr(), _pointer(offsets)):
        return None
    return Int16Weight(quants, scales, offsets, n, in_features, bits)


def scale_dtype() -> torch.dtype:
    """How this machine's build keeps a packed weight's scales and offsets: float16 on AVX-512
    and AVX2 (exactly the file's), float32 in the portable build (and where the library is
    unavailable)."""
    library = load()
    return torch.float16 if library is not None and library.i16_scale_bytes() == 2 \
        else torch.float32


def quant_bits(qtype: int) -> int:
    """Bits a packed quant of this (float-scale) format takes."""
    return 4 if qtype in NIBBLES else 8


def matmul(x: torch.Tensor, weight: Int16Weight) -> torch.Tensor:
    """x (M, K) float32 @ weight^T -> (M, N) float32, x rounded to int16 per block of 32."""
    k = weight.in_features
    x = cpu_quant.input_rows(x, k)
    m = x.shape[0]
    out = torch.empty(m, weight.out_features)
    if m == 0:
        return out
    library = load()
    quants = torch.empty(m, k, dtype=torch.int16)
    scales = torch.empty(m, k // BLOCK)
    sums = torch.empty_like(scales) if weight.offsets is not None else None
    library.i16_quantize_rows(x.data_ptr(), m, k, quants.data_ptr(), scales.data_ptr(),
                              _pointer(sums))
    if not library.i16_matmul(quants.data_ptr(), scales.data_ptr(), _pointer(sums), m,
                              weight.quants.data_ptr(), weight.scales.data_ptr(),
                              _pointer(weight.offsets), weight.out_features, k,
                              weight.bits, out.data_ptr()):
        raise MemoryError("int16 matmul: no memory for a panel buffer")
    return out


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
