"""Linear layers over GGUF-quantised weights on CPU ("native" weights).

A QuantizedWeight keeps the file's blocks (Q4_0, Q4_1, Q8_0) and has five ways to multiply:
- fused (kernels/cpu_quant_matmul.c): each row dequantised on the fly; decode, bound by the
  bytes read per token, reads 5 bits a weight instead of 32;
- int16 (kernels/cpu_int16_matmul.c): a copy of the quants repacked in 16-row vectors (4 bits
  each for Q4_0/Q4_1, as in the file) and the inputs rounded to int16 per block of 32, summed
  with AVX-512 VNNI at twice float32's multiply-adds a cycle: for many rows, where
  multiply-adds are the bottleneck, and for 1-4 rows too, where the quants are widened in
  registers and the fused kernel's float dequantisation is the bottleneck;
- bf16dot (kernels/cpu_bf16_matmul.c): a copy of the dequantised weight in bfloat16 pairs,
  summed by AVX-512 BF16 dot products inside the one-call decode stack, for the decode steps
  of a batch (on a Zen 5, 8-63 rows: 1.7x int16 at 32), with the inputs rounded to bfloat16;
- dense: a float matrix product over the weight dequantised into a scratch buffer (never
  kept);
- bfloat16: a kept copy of the dequantised weight in bfloat16, multiplied by torch (oneDNN:
  AVX-512 bf16 dot products, AMX tiles where the CPU has them) with the inputs rounded to
  bfloat16 and the outputs widened back, where the CPU has native bfloat16 instructions.
Which one takes how many rows is measured per weight shape when the model loads
(`path_choice.measure_crossovers`), never assumed, so the weight format follows the step size: the file's
blocks for the few rows of a decode step, a matrix-unit format for a batch or a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokstream.kernels import cpu_bf16_dot, cpu_decode_stack, cpu_int16, cpu_quant
from tokstream.worker.onednn_linear import BfloatWeight

NEVER = 1 << 62


@dataclass
class QuantizedWeight:
    """One weight matrix in its GGUF blocks; behaves as the (out, in) matrix of F.linear."""

    data: torch.Tensor
    """(out_features, in_features / 32 * block_bytes) uint8, rows in output order."""
    qtype: int
    """ggml type id (cpu_quant.QTYPES)."""
    in_features: int
    crossover: int = NEVER
    """Products with at least this many input rows dequantise and use a float matmul."""
    int16: cpu_int16.Int16Weight | None = None
    """The int16 copy, kept only where the measurement gave it some rows."""
    int16_rows: tuple[tuple[int, int], ...] = ()
    """Row counts whose products use int16 (below float_from): half-open ranges [lo, hi),
    at most MAX_INT16_RANGES. Not one threshold: int16 and fused can trade places as rows grow
    (on a Zen 5, int16 26% faster at 1-4 rows, 3% slower at 8, faster again from 16), and a
    threshold had to give all of 1-8 to fused for that near-tie at 8."""
    bf16dot: cpu_bf16_dot.Bf16DotWeight | None = None
    """The dequantised weight in bfloat16 pairs for the AVX-512 BF16 kernel of the decode
    stack (cpu_bf16_matmul.c), kept only where the measurement gave it some rows."""
    bf16dot_rows: tuple[tuple[int, int], ...] = ()
    """Row counts whose products use bf16dot (below float_from), as int16_rows."""
    bfloat16: BfloatWeight | None = None
    """The dequantised weight in bfloat16 (oneDNN's layout), kept only where the measurement
    gave it some rows."""
    bfloat16_from: int = NEVER
    """Products with at least this many input rows use the bfloat16 copy (before any other
    path)."""

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def nbytes(self) -> int:
        return self.data.numel() + self.copy_bytes()

    def copy_bytes(self) -> int:
        """Bytes of the extra forms kept beside the file's blocks (int16, bf16dot, bfloat16)."""
        return ((self.int16.nbytes() if self.int16 is not None else 0)
                + (self.bf16dot.nbytes() if self.bf16dot is not None else 0)
                + (self.bfloat16.nbytes if self.bfloat16 is not None else 0))

    @property
    def float_from(self) -> int:
        """The fewest rows whose product leaves the quantised kernels (dense or bfloat16)."""
        return min(self.crossover, self.bfloat16_from if self.bfloat16 is not None else NEVER)

    def path(self, rows: int) -> str:
        """'fused', 'int16', 'bf16dot', 'dense' or 'bfloat16': how a product with this many
        input rows is taken."""
        if rows >= self.bfloat16_from and self.bfloat16 is not None:
            return "bfloat16"
        if rows >= self.crossover:
            return "dense"
        if self.bf16dot is not None and any(lo <= rows < hi for lo, hi in self.bf16dot_rows):
            return "bf16dot"
        if self.int16 is not None and any(lo <= rows < hi for lo, hi in self.int16_rows):
            return "int16"
        return "fused"

    def rows(self, begin: int, end: int) -> "QuantizedWeight":
        """Output features [begin, end): a column-parallel shard."""
        return QuantizedWeight(self.data[begin:end].contiguous(), self.qtype, self.in_features)

    def columns(self, begin: int, end: int) -> "QuantizedWeight":
        """Input features [begin, end), which must fall on block bounds: a row-parallel shard."""
        if begin % cpu_quant.BLOCK or end % cpu_quant.BLOCK:
            raise ValueError(f"input slice {begin}:{end} splits a {cpu_quant.BLOCK}-weight block")
        per_block = cpu_quant.BLOCK_BYTES[self.qtype]
        data = self.data[:, begin // cpu_quant.BLOCK * per_block:end // cpu_quant.BLOCK * per_block]
        return QuantizedWeight(data.contiguous(), self.qtype, end - begin)

    def padded_rows(self, rows: int) -> "QuantizedWeight":
        """Zero rows appended up to `rows` (all-zero blocks dequantise to 0.0)."""
        data = torch.zeros(rows, self.data.shape[1], dtype=torch.uint8)
        data[:self.out_features] = self.data
        return QuantizedWeight(data, self.qtype, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32, exactly ggml's dequantised values."""
        return cpu_quant.dequantize(self.data, self.qtype, self.in_features)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantised: (T,) -> (T, in) float32, an embedding lookup."""
        return cpu_quant.dequantize(self.data.index_select(0, ids), self.qtype, self.in_features)


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights with the same inputs and format along the outputs ([q; k; v])."""
    first = weights[0]
    if any(w.qtype != first.qtype or w.in_features != first.in_features for w in weights):
        raise ValueError("only weights of one format and input size can be stacked")
    return QuantizedWeight(torch.cat([w.data for w in weights]), first.qtype, first.in_features)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None, narrow: bool = False) -> torch.Tensor:
    """F.linear with a QuantizedWeight: x (T, in) float32 -> (T, out) float32. x may be
    bfloat16 (a narrow result handed on); narrow: the caller takes the bfloat16 path's result
    as it comes, unwidened (other paths give float32 whatever it says)."""
    path = weight.path(x.shape[0])
    if path == "bfloat16":
        out = weight.bfloat16(x, narrow=narrow and bias is None)
        if bias is not None:
            out += bias
        return out
    x = x.float()  # a no-op for float32
    if path == "dense":
        out = F.linear(x, dequantized(weight))
    elif path == "int16":
        out = cpu_int16.matmul(x, weight.int16)
    elif path == "bf16dot":
        out = cpu_bf16_dot.matmul(x, weight.bf16dot)
    else:
        out = cpu_quant.matmul(x, weight.data, weight.qtype, weight.in_features)
    if bias is not None:
        out += bias
    return out


def gated_on_bf16dot(weight, rows: int) -> bool:
    """Whether a [gate; up] product of this many rows with `weight` runs on its bf16dot copy,
    where SiLU(gate) * up comes out of the product itself (cpu_bf16_dot.matmul_silu)."""
    return (isinstance(weight, QuantizedWeight) and weight.path(rows) == "bf16dot"
            and weight.out_features % (2 * cpu_bf16_dot.LANES) == 0)


def takes_bfloat16(weight, rows: int) -> bool:
    """Whether a product of this many rows with `weight` runs on its bfloat16 copy (a weight
    of another kind never does): its input is rounded to bfloat16 there anyway."""
    return isinstance(weight, QuantizedWeight) and weight.path(rows) == "bfloat16"


_scratch: torch.Tensor | None = None


def dequantized(weight: QuantizedWeight) -> torch.Tensor:
    """The weight in float32, in a scratch buffer reused by every layer (one at a time)."""
    global _scratch
    size = weight.out_features * weight.in_features
    if _scratch is None or _scratch.numel() < size:
        _scratch = torch.empty(size, dtype=torch.float32)
    out = _scratch[:size].view(weight.out_features, weight.in_features)
    return cpu_quant.dequantize(weight.data, weight.qtype, weight.in_features, out=out)


MAX_INT16_RANGES = cpu_decode_stack.MAX_INT16_RANGES
"""Row ranges a weight's int16 choice may take (the C decode stack's table has room for
these; PROBE_ROWS' ten sizes make at most five)."""
