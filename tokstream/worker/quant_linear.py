"""Linear layers over GGUF-quantised weights on CPU ("native" weights).

A QuantizedWeight keeps the file's blocks (Q4_0, Q4_1, Q8_0) and has three ways to multiply:
- fused (kernels/cpu_quant_matmul.c): each row dequantised on the fly; decode, bound by the
  bytes read per token, reads 5 bits a weight instead of 32;
- int16 (kernels/cpu_int16_matmul.c): a copy of the quants as int16 and the inputs rounded to
  int16 per block of 32, summed with AVX-512 VNNI at twice float32's multiply-adds a cycle,
  for products with many rows, where multiply-adds are the bottleneck;
- dense: a float matrix product over the weight dequantised into a scratch buffer (never
  kept).
Which one takes how many rows is measured per weight shape when the model loads
(`measure_crossovers`), never assumed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokstream.kernels import cpu_int16, cpu_quant
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
    int16: cpu_int16.Int16Weight | None = None
    """The int16 copy, kept only where the measurement gave it some rows."""
    int16_from: int = NEVER
    """Products with at least this many input rows (and fewer than crossover) use int16."""

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def nbytes(self) -> int:
        return self.data.numel() + (self.int16.nbytes() if self.int16 is not None else 0)

    def path(self, rows: int) -> str:
        """'fused', 'int16' or 'dense': how a product with this many input rows is taken."""
        if rows >= self.crossover:
            return "dense"
        if rows >= self.int16_from and self.int16 is not None:
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
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a QuantizedWeight: x (T, in) float32 -> (T, out) float32."""
    path = weight.path(x.shape[0])
    if path == "dense":
        out = F.linear(x, _dequantized(weight))
    elif path == "int16":
        out = cpu_int16.matmul(x, weight.int16)
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


PATHS = ("fused", "int16", "dense")


def measure_crossover(weight: QuantizedWeight) -> tuple[dict[str, int], list[dict]]:
    """From how many rows each path takes over ({'int16': rows, 'dense': rows}, NEVER where it
    never does), and the timings behind it. A path takes over at the smallest probed size
    where it is the fastest of the three and stays so for every larger probed size; the
    int16 path is timed only when the weight has its copy. Stops once dense has won at two
    sizes in a row (its efficiency only grows with rows)."""
    rows, dense_wins = [], 0
    timed = [p for p in PATHS if p != "int16" or weight.int16 is not None]
    for m in PROBE_ROWS:
        x = torch.randn(m, weight.in_features)
        run = {"fused": lambda: cpu_quant.matmul(x, weight.data, weight.qtype,
                                                 weight.in_features),
               "int16": lambda: cpu_int16.matmul(x, weight.int16),
               "dense": lambda: F.linear(x, _dequantized(weight))}
        times = {p: probe_cache.best_time(run[p]) for p in timed}
        rows.append({"rows": m, **{f"{p}_ms": round(t * 1e3, 4) for p, t in times.items()},
                     "fastest": min(times, key=times.get)})
        dense_wins = dense_wins + 1 if rows[-1]["fastest"] == "dense" else 0
        if dense_wins == 2:
            break
    return {p: _takes_over(rows, p) for p in timed if p != "fused"}, rows


def _takes_over(rows: list[dict], path: str) -> int:
    """The smallest probed size from which `path` is the fastest, or a later path (dense
    after int16) is, at every larger probed size; NEVER if none."""
    later = PATHS[PATHS.index(path):]
    start = NEVER
    for row in reversed(rows):
        if row["fastest"] not in later:
            break
        if row["fastest"] == path or start != NEVER:
            start = row["rows"]
    return start


STREAMED_BELOW = 64
"""Below this many rows the int16 path is timed over every weight in model order as well: its
weights take 16 bits where the fused kernel reads 5, so where the bytes read bound the
product, one weight timed alone (warm in the caches) flatters it (measured: int16 fastest
from 1 row alone, but a batch-1 step 13.2 ms with it against 9.1 ms without)."""


def measure_crossovers(weights: list[QuantizedWeight]) -> dict[str, dict]:
    """Set every weight's crossovers (int16_from, crossover) and give int16 copies to those
    that use them. Each distinct (format, out, in) shape is measured alone (three paths, hot
    in the caches); then, below STREAMED_BELOW rows, int16 against fused over all the
    weights in order, as a forward pass streams them. Measured once per machine (cached
    beside the compiled kernels; a measurement taken while the machine was busier than its
    cores is not kept). Returns the measurements, for the log."""
    by_shape: dict[tuple, list[QuantizedWeight]] = {}
    for w in weights:
        by_shape.setdefault((w.qtype, w.out_features, w.in_features), []).append(w)
    path = probe_cache.path("crossover", str(torch.get_num_threads()),
                            cpu_quant.SOURCE.read_text(), cpu_int16.SOURCE.read_text(),
                            repr(sorted(by_shape)), repr(PROBE_ROWS), str(STREAMED_BELOW))
    report = probe_cache.load(path)
    if report is None or any(_shape_name(s) not in report for s in by_shape):
        report, load_average = {}, os.getloadavg()[0]
        with torch.inference_mode():
            for shape, same in by_shape.items():
                _give_int16(same[0])
                starts, rows = measure_crossover(same[0])
                report[_shape_name(shape)] = {
                    **{f"{p}_from_rows": None if starts.get(p, NEVER) == NEVER
                       else starts[p] for p in ("int16", "dense")},
                    "timings": rows}
            for w in weights:
                _give_int16(w)
            report["streamed"] = measure_streamed(weights)
        probe_cache.store(path, report, load_average)
    streamed_from = report["streamed"]["int16_from_rows"]
    for shape, same in by_shape.items():
        found = report[_shape_name(shape)]
        int16_from, dense_from = found["int16_from_rows"], found["dense_from_rows"]
        if int16_from is not None:
            int16_from = max(int16_from, streamed_from)
        for w in same:
            w.crossover = NEVER if dense_from is None else dense_from
            if int16_from is None or int16_from >= w.crossover:
                w.int16, w.int16_from = None, NEVER  # never used: no copy kept
            else:
                w.int16_from = int16_from
                _give_int16(w)
        log.info("native %s: int16 from %s rows, dequantise + matmul from %s",
                 _shape_name(shape), int16_from or "no number of", dense_from or "none")
    return report


def measure_streamed(weights: list[QuantizedWeight]) -> dict:
    """The fewest rows below STREAMED_BELOW from which int16 beats fused over every weight
    that has an int16 copy, taken in order (STREAMED_BELOW if at none), and the timings."""
    packed = [w for w in weights if w.int16 is not None]
    rows, start = [], STREAMED_BELOW
    for m in (m for m in PROBE_ROWS if m < STREAMED_BELOW and packed):
        inputs = {w.in_features: torch.randn(m, w.in_features) for w in packed}

        def fused():
            for w in packed:
                cpu_quant.matmul(inputs[w.in_features], w.data, w.qtype, w.in_features)

        def int16():
            for w in packed:
                cpu_int16.matmul(inputs[w.in_features], w.int16)

        times = {"fused": probe_cache.best_time(fused, 3),
                 "int16": probe_cache.best_time(int16, 3)}
        rows.append({"rows": m, **{f"{p}_ms": round(t * 1e3, 4) for p, t in times.items()}})
    for row in reversed(rows):  # int16 must win at every probed size from its start on
        if row["int16_ms"] >= row["fused_ms"]:
            break
        start = row["rows"]
    return {"int16_from_rows": start, "timings": rows}


def _give_int16(weight: QuantizedWeight) -> None:
    if weight.int16 is None:
        weight.int16 = cpu_int16.pack(weight.data, weight.qtype, weight.in_features)


def _shape_name(shape: tuple) -> str:
    qtype, out_features, in_features = shape
    return f"type{qtype}:{out_features}x{in_features}"
