"""Linear layers over GGUF-quantised weights on CPU ("native" weights).

A QuantizedWeight keeps the file's blocks (Q4_0, Q4_1, Q8_0) and has four ways to multiply:
- fused (kernels/cpu_quant_matmul.c): each row dequantised on the fly; decode, bound by the
  bytes read per token, reads 5 bits a weight instead of 32;
- int16 (kernels/cpu_int16_matmul.c): a copy of the quants repacked in 16-row vectors (4 bits
  each for Q4_0/Q4_1, as in the file) and the inputs rounded to int16 per block of 32, summed
  with AVX-512 VNNI at twice float32's multiply-adds a cycle: for many rows, where
  multiply-adds are the bottleneck, and for 1-4 rows too, where the quants are widened in
  registers and the fused kernel's float dequantisation is the bottleneck;
- dense: a float matrix product over the weight dequantised into a scratch buffer (never
  kept);
- bfloat16: a kept copy of the dequantised weight in bfloat16, multiplied by torch (oneDNN:
  AVX-512 bf16 dot products, AMX tiles where the CPU has them) with the inputs rounded to
  bfloat16 and the outputs widened back, where the CPU has native bfloat16 instructions.
Which one takes how many rows is measured per weight shape when the model loads
(`measure_crossovers`), never assumed, so the weight format follows the step size: the file's
blocks for the few rows of a decode step, a matrix-unit format for a batch or a prefill.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokstream.kernels import cpu_int16, cpu_quant
from tokstream.worker import probe_cache
from tokstream.worker.onednn_linear import BfloatWeight

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
        """Bytes of the extra forms kept beside the file's blocks (int16, bfloat16)."""
        return ((self.int16.nbytes() if self.int16 is not None else 0)
                + (self.bfloat16.nbytes if self.bfloat16 is not None else 0))

    @property
    def float_from(self) -> int:
        """The fewest rows whose product leaves the quantised kernels (dense or bfloat16)."""
        return min(self.crossover, self.bfloat16_from if self.bfloat16 is not None else NEVER)

    def path(self, rows: int) -> str:
        """'fused', 'int16', 'dense' or 'bfloat16': how a product with this many input rows
        is taken."""
        if rows >= self.bfloat16_from and self.bfloat16 is not None:
            return "bfloat16"
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
    if path == "bfloat16":
        out = weight.bfloat16(x)
    elif path == "dense":
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


PATHS = ("fused", "int16", "dense", "bfloat16")
"""In the order they take over as rows grow: a later path's start is never below an
earlier one's."""


def measure_crossover(weight: QuantizedWeight) -> tuple[dict[str, int], list[dict]]:
    """From how many rows each path takes over ({'int16': rows, 'dense': rows, 'bfloat16':
    rows}, NEVER where it never does), and the timings behind it (see starts_from_timings);
    int16 and bfloat16 are timed only when the weight has their copy. Stops once the last
    timed path has won at two sizes in a row, the second at STREAMED_BELOW rows or more (a
    float matrix product's efficiency only grows with rows; a bfloat16 win at one and two
    rows, hot in the caches, had ended a probe before it reached a batch's size)."""
    rows, last_wins = [], 0
    timed = [p for p in PATHS if _has_form(weight, p)]
    for m in PROBE_ROWS:
        x = torch.randn(m, weight.in_features)
        times = probe_cache.best_times({p: _runner(x, weight, p) for p in timed})
        rows.append({"rows": m, **{f"{p}_ms": round(t * 1e3, 4) for p, t in times.items()}})
        last_wins = last_wins + 1 if min(times, key=times.get) == timed[-1] else 0
        if last_wins >= 2 and m >= STREAMED_BELOW:  # a win at a few rows may be the caches'
            break
    return starts_from_timings(rows, timed), rows


def starts_from_timings(rows: list[dict], paths: list[str]) -> dict[str, int]:
    """Where each of `paths` but fused takes over, among those paths only: at the smallest
    probed size from which it is the fastest, or a later path is, at every larger size."""
    fastest = [{"rows": row["rows"], "fastest": min(paths, key=lambda p: row[f"{p}_ms"])}
               for row in rows if all(f"{p}_ms" in row for p in paths)]
    return {p: _takes_over(fastest, p, paths) for p in paths if p != "fused"}


def _has_form(weight: QuantizedWeight, path: str) -> bool:
    return getattr(weight, path) is not None if path in COPIES else True


def _runner(x: torch.Tensor, weight: QuantizedWeight, path: str):
    """A call that takes the product by `path` alone (whatever the weight's own choice)."""
    if path == "fused":
        return lambda: cpu_quant.matmul(x, weight.data, weight.qtype, weight.in_features)
    if path == "int16":
        return lambda: cpu_int16.matmul(x, weight.int16)
    if path == "dense":
        return lambda: F.linear(x, _dequantized(weight))
    return lambda: weight.bfloat16(x)


def _takes_over(rows: list[dict], path: str, paths: list[str] | tuple = PATHS) -> int:
    """The smallest probed size from which `path` is the fastest, or a later path (dense
    after int16) is, at every larger probed size; NEVER if none."""
    later = paths[paths.index(path):]
    start = NEVER
    for row in reversed(rows):
        if row["fastest"] not in later:
            break
        if row["fastest"] == path or start != NEVER:
            start = row["rows"]
    return start


STREAMED_BELOW = 64
"""Below this many rows the int16 and bfloat16 paths are timed over every weight in model
order as well: their weights take 16 bits where the fused kernel reads 5, so where the bytes
read bound the product, one weight timed alone (warm in the caches) flatters them (measured:
int16 fastest from 1 row alone, but a batch-1 step 13.2 ms with it against 9.1 ms without)."""
STACK_MARGIN = 0.5
"""Below STREAMED_BELOW rows a bfloat16 copy must take under this fraction of the quantised
paths' time: its products leave the one-call decode stack (cpu_decode_stack.c) for the
per-layer Python path, whose cost the streamed timing (every path called from Python) does not
show. Measured on a Zen 4 (batch-32 decode steps, alternated three times): streamed products
bfloat16 35.2 ms against int16's 41.6 (0.85), yet the step 89.8 ms with them against 72.6 ms
on int16 in the stack. On a Zen 5 (amd-f26m2-bf16) 0.75 let bfloat16 in at 32 rows, streamed
19.2 ms against int16's 25.6 (0.75), and 32 streams served 374 tok/s against 502 with int16
in the stack (bench/compare_vllm.py, default against --weights native, one quiet run): even
at 0.75 the stack won by a third, so a copy must halve the time to pay for leaving it."""
COPIES = ("bfloat16", "int16")
"""The extra forms a weight may keep beside its blocks, in the order a memory budget gives
them out (bfloat16 serves the many-row steps, prefill among them, where the matrix units
gain the most)."""


def measure_crossovers(weights: list[QuantizedWeight], copy_budget: int | None = None,
                       bfloat16: list[QuantizedWeight] = ()) -> dict[str, dict]:
    """Set every weight's path starts (int16_from, crossover, bfloat16_from) and give it the
    copies it uses, within `copy_budget` bytes of copies (None: no limit); only the weights
    in `bfloat16` may have a bfloat16 copy (a CPU with native bfloat16 instructions, and not
    the LM head: rounding its weights decides near-ties between tokens directly). Each
    distinct (format, out, in) shape is timed alone on every path (hot in the caches); then,
    below STREAMED_BELOW rows, each copy's path against fused over all the weights that may
    have it, in order, as a forward pass streams them. Timed once per machine (cached beside
    the compiled kernels; a measurement taken while the machine was busier than its cores is
    not kept). Returns the measurements, with the copies' bytes, for the log."""
    may_bfloat16 = {id(w) for w in bfloat16}
    by_shape: dict[tuple, list[QuantizedWeight]] = {}
    for w in weights:
        by_shape.setdefault((w.qtype, w.out_features, w.in_features), []).append(w)
    path = probe_cache.path("crossover", str(torch.get_num_threads()),
                            cpu_quant.SOURCE.read_text(), cpu_int16.SOURCE.read_text(),
                            cpu_quant.SOURCE.with_name("cpu_vector_math.h").read_text(),
                            Path(__file__).read_text(),  # how it probes and decides
                            repr(sorted(by_shape)), repr(PROBE_ROWS), str(STREAMED_BELOW),
                            repr(sorted(_shape_name(s) for s, same in by_shape.items()
                                        if id(same[0]) in may_bfloat16)))
    report = probe_cache.load(path)
    if report is None or any(_shape_name(s) not in report for s in by_shape):
        report = _measure(weights, by_shape, may_bfloat16)
        probe_cache.store(path, report, report.pop("load_average"))
    _apply(by_shape, report, copy_budget, may_bfloat16)
    kept = sum(w.copy_bytes() for w in weights)
    log.info("native weights: %.1f MiB of copies kept beside %.1f MiB of blocks%s",
             kept / 2**20, sum(w.data.numel() for w in weights) / 2**20,
             "" if copy_budget is None else f" (budget {copy_budget / 2**20:.1f} MiB)")
    return {**report, "copy_bytes": kept}


def _forms(weight: QuantizedWeight, may_bfloat16: set[int]) -> list[str]:
    return [f for f in COPIES if f == "int16" or id(weight) in may_bfloat16]


def _measure(weights, by_shape, may_bfloat16) -> dict:
    report, load_average = {}, os.getloadavg()[0]
    with torch.inference_mode():
        for shape, same in by_shape.items():
            forms = _forms(same[0], may_bfloat16)
            _give(same[0], forms)
            _, rows = measure_crossover(same[0])
            report[_shape_name(shape)] = {"timings": rows}
            _drop(same[0], forms)
        for form in COPIES:
            eligible = [w for w in weights if form in _forms(w, may_bfloat16)]
            for w in eligible:  # bfloat16 is timed against int16 as well
                _give(w, [form, "int16"])
            report[f"streamed_{form}"] = measure_streamed(eligible, form)
            for w in eligible:
                _drop(w, COPIES)
    return {**report, "load_average": load_average}


def _apply(by_shape, report, copy_budget, may_bfloat16) -> None:
    """Each weight's starts from its shape's timings, over the paths whose copies it is
    given: form by form (COPIES' order), each weight in model order that the form would take
    some rows of, while the budget lasts."""
    left = NEVER if copy_budget is None else copy_budget
    held: dict[int, list[str]] = {}
    for form in COPIES:
        for shape, same in by_shape.items():
            rows = report[_shape_name(shape)]["timings"]
            if not rows or f"{form}_ms" not in rows[0]:
                continue  # not timed: no such copy at this shape
            for w in same:
                if form not in _forms(w, may_bfloat16):
                    continue
                mine = held.setdefault(id(w), [])
                paths = [p for p in PATHS if p not in COPIES or p in mine or p == form]
                start = _streamed_start(starts_from_timings(rows, paths)[form], report, form)
                size = _form_bytes(w, form)
                if start != NEVER and size <= left:
                    mine.append(form)
                    left -= size
    for shape, same in by_shape.items():
        rows = report[_shape_name(shape)]["timings"]
        for w in same:
            mine = held.get(id(w), [])
            starts = starts_from_timings(rows, [p for p in PATHS if p not in COPIES
                                                or p in mine])
            _drop(w, COPIES)
            _give(w, mine)
            w.crossover = starts["dense"]
            w.int16_from = _streamed_start(starts.get("int16", NEVER), report, "int16")
            w.bfloat16_from = _streamed_start(starts.get("bfloat16", NEVER), report, "bfloat16")
        log.info("native %s: int16 from %s rows, bfloat16 from %s, dequantise + matmul "
                 "from %s", _shape_name(shape), *(_rows_text(getattr(same[0], a)) for a in
                                                  ("int16_from", "bfloat16_from", "crossover")))


def _streamed_start(start: int, report: dict, form: str) -> int:
    streamed = report.get(f"streamed_{form}", {}).get("from_rows", STREAMED_BELOW)
    return NEVER if start == NEVER else max(start, streamed)


def _rows_text(rows: int) -> str:
    return "none" if rows == NEVER else str(rows)


def _form_bytes(weight: QuantizedWeight, form: str) -> int:
    """Bytes the form's copy of the weight takes (int16: 4- or 8-bit quants, float32 scales
    and the 4-bit formats' offsets, one of each per 32 weights)."""
    n = weight.out_features * weight.in_features
    if form == "bfloat16":
        return 2 * n
    widened = weight.qtype % cpu_quant.FLOAT_SCALES + cpu_quant.FLOAT_SCALES
    scales = 2 if widened in cpu_int16.WITH_OFFSETS else 1
    return n * cpu_int16.quant_bits(widened) // 8 + n // cpu_int16.BLOCK * 4 * scales


def measure_streamed(weights: list[QuantizedWeight], form: str = "int16") -> dict:
    """The fewest rows below STREAMED_BELOW from which `form`'s path beats the quantised
    paths (fused, and int16 against bfloat16) over every weight that has that copy, taken in
    order (STREAMED_BELOW if at none), and the timings."""
    packed = [w for w in weights if _has_form(w, form)]
    int16_too = form == "bfloat16" and all(w.int16 is not None for w in packed)
    rivals = ["fused", "int16"] if int16_too else ["fused"]
    rows, start = [], STREAMED_BELOW
    for m in (m for m in PROBE_ROWS if m < STREAMED_BELOW and packed):
        inputs = {w.in_features: torch.randn(m, w.in_features) for w in packed}
        runs = {p: [_runner(inputs[w.in_features], w, p) for w in packed]
                for p in (*rivals, form)}
        times = probe_cache.best_times({p: _calling(calls) for p, calls in runs.items()}, 3)
        rows.append({"rows": m, **{f"{p}_ms": round(t * 1e3, 4) for p, t in times.items()}})
    margin = STACK_MARGIN if form == "bfloat16" else 1.0
    for row in reversed(rows):  # the form must win at every probed size from its start on
        if row[f"{form}_ms"] >= margin * min(row[f"{p}_ms"] for p in rivals):
            break
        start = row["rows"]
    return {"from_rows": start, "timings": rows}


def _calling(calls: list):
    return lambda: [run() for run in calls]


def _give(weight: QuantizedWeight, forms) -> None:
    if "int16" in forms and weight.int16 is None:
        weight.int16 = cpu_int16.pack(weight.data, weight.qtype, weight.in_features)
    if "bfloat16" in forms and weight.bfloat16 is None:
        weight.bfloat16 = BfloatWeight(weight.dequantize())


def _drop(weight: QuantizedWeight, forms) -> None:
    if "int16" in forms:
        weight.int16, weight.int16_from = None, NEVER
    if "bfloat16" in forms:
        weight.bfloat16, weight.bfloat16_from = None, NEVER


def _shape_name(shape: tuple) -> str:
    qtype, out_features, in_features = shape
    return f"type{qtype}:{out_features}x{in_features}"
