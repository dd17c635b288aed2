"""Linear layers over GGUF-quantised weights on CPU ("native" weights).

A QuantizedWeight keeps the file's blocks (Q4_0, Q4_1, Q8_0) and multiplies through
kernels/cpu_quant_matmul.c, which dequantises each row on the fly: decode, bound by the bytes
read per token, reads 5 bits a weight instead of 32. Past some number of input rows a float
matrix product over the dequantised weight (dequantised on the fly into a scratch buffer,
never kept) is faster; that crossover is measured per weight shape when the model loads
(`measure_crossovers`), never assumed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokstream.kernels import cpu_quant
from tokstream.worker import probe_cache

log = logging.getLogger("tokstream.worker")

PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Input row counts timed when measuring a shape's crossover: up to prefill sizes, where a
float matmul's efficiency keeps rising and the fused kernel's does not (measured: a
1,024-token prefill step's linears took 1.6x as long when the probe stopped at 128 rows, where
the two were level, and left the fused kernel in charge)."""
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

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def nbytes(self) -> int:
        return self.data.numel()

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
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a QuantizedWeight: x (T, in) float32 -> (T, out) float32."""
    if x.shape[0] >= weight.crossover:
        out = F.linear(x, _dequantized(weight))
    else:
        out = cpu_quant.matmul(x, weight.data, weight.qtype, weight.in_features)
    if bias is not None:
        out += bias
    return out


_scratch: torch.Tensor | None = None


def _dequantized(weight: QuantizedWeight) -> torch.Tensor:
    """The weight in float32, in a scratch buffer reused by every layer (one at a time)."""
    global _scratch
    size = weight.out_features * weight.in_features
    if _scratch is None or _scratch.numel() < size:
        _scratch = torch.empty(size, dtype=torch.float32)
    out = _scratch[:size].view(weight.out_features, weight.in_features)
    return cpu_quant.dequantize(weight.data, weight.qtype, weight.in_features, out=out)


def measure_crossover(weight: QuantizedWeight) -> tuple[int, list[dict]]:
    """The smallest probed row count from which dequantise + float matmul beats the fused
    kernel (NEVER if it does not), and the timings behind it. Stops once the float path has
    won at two sizes in a row."""
    rows, wins = [], 0
    crossover = NEVER
    for m in PROBE_ROWS:
        x = torch.randn(m, weight.in_features)
        fused = probe_cache.best_time(
            lambda: cpu_quant.matmul(x, weight.data, weight.qtype, weight.in_features))
        dense = probe_cache.best_time(lambda: F.linear(x, _dequantized(weight)))
        rows.append({"rows": m, "fused_ms": round(fused * 1e3, 4),
                     "dequantize_matmul_ms": round(dense * 1e3, 4)})
        if dense < fused:
            crossover = min(crossover, m)
            wins += 1
            if wins == 2:
                break
        else:
            crossover, wins = NEVER, 0  # a crossover must hold for the sizes after it
    return crossover, rows


def measure_crossovers(weights: list[QuantizedWeight]) -> dict[str, dict]:
    """Set every weight's crossover, measuring each distinct (format, out, in) shape once per
    machine (cached beside the compiled kernels; a measurement taken while the machine was
    busier than its cores is not kept). Returns the measurements by shape, for the log."""
    by_shape: dict[tuple, list[QuantizedWeight]] = {}
    for w in weights:
        by_shape.setdefault((w.qtype, w.out_features, w.in_features), []).append(w)
    path = probe_cache.path("crossover", str(torch.get_num_threads()),
                            cpu_quant.SOURCE.read_text(), repr(sorted(by_shape)),
                            repr(PROBE_ROWS))
    report = probe_cache.load(path)
    if report is None or any(_shape_name(s) not in report for s in by_shape):
        report, load_average = {}, os.getloadavg()[0]
        with torch.inference_mode():
            for shape, same in by_shape.items():
                crossover, rows = measure_crossover(same[0])
                report[_shape_name(shape)] = {
                    "crossover_rows": None if crossover == NEVER else crossover,
                    "timings": rows}
        probe_cache.store(path, report, load_average)
    for shape, same in by_shape.items():
        found = report[_shape_name(shape)]["crossover_rows"]
        for w in same:
            w.crossover = NEVER if found is None else found
        log.info("native %s: dequantise + matmul from %s rows", _shape_name(shape),
                 found or "no number of")
    return report


def _shape_name(shape: tuple) -> str:
    qtype, out_features, in_features = shape
    return f"type{qtype}:{out_features}x{in_features}"
