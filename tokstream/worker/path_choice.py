"""Which path a native weight's product takes at each row count, and which copies it keeps:
timed per weight shape and row count when the model loads (`measure_crossovers`), cached per
machine (probe_cache), never assumed. The paths themselves are quant_linear's.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from tokstream.kernels import cpu_bf16_dot, cpu_decode_stack, cpu_int16, cpu_quant
from tokstream.worker import probe_cache
from tokstream.worker.onednn_linear import BfloatWeight
from tokstream.worker.quant_linear import NEVER, QuantizedWeight, dequantized

log = logging.getLogger("tokstream.worker")

PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Input row counts timed when measuring a shape's crossover: up to prefill sizes, where a
float matmul's efficiency keeps rising and the fused kernel's does not (measured: a
1,024-token prefill step's linears took 1.6x as long when the probe stopped at 128 rows, where
the two were level, and left the fused kernel in charge)."""

PATHS = ("fused", "int16", "bf16dot", "dense", "bfloat16")
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


STACK_PATHS = ("fused", "int16", "bf16dot")
"""The paths the one-call decode stack runs: each takes the probed sizes it wins."""


def stack_sizes(rows: list[dict], float_from: int, streamed: list[dict],
                held: list[str]) -> dict[str, list[int]]:
    """Which probed sizes below float_from (where a float path takes over) each held copy's
    path takes: the fastest of fused and the held stack paths, by the shape's own timing from
    STREAMED_BELOW rows on, and below it by `streamed` (every weight in order, as a step runs
    them: one weight alone, warm in the caches, flatters the copies) where that path also
    beats fused in the shape's own timing. Each size on its own, so a near-tie at one size
    costs a path that size only."""
    taken: dict[str, list[int]] = {p: [] for p in held if p in STACK_PATHS}
    by_size = {row["rows"]: row for row in streamed}
    for row in rows:
        m = row["rows"]
        if m >= float_from:
            continue
        timed = row if m >= STREAMED_BELOW else by_size.get(m)
        if timed is None:
            continue
        paths = [p for p in ("fused", *taken) if f"{p}_ms" in timed and f"{p}_ms" in row]
        best = min(paths, key=lambda p: timed[f"{p}_ms"])
        leaner = [p for p in paths if p != "bf16dot"]
        if best == "bf16dot" and min(timed[f"{p}_ms"] for p in leaner) * BYTES_MARGIN \
                <= timed["bf16dot_ms"]:
            best = min(leaner, key=lambda p: timed[f"{p}_ms"])
        if best != "fused" and row[f"{best}_ms"] < row["fused_ms"]:
            taken[best].append(m)
    return taken


BYTES_MARGIN = 0.9
"""bf16dot reads 16 bits a weight where fused and int16 read 4-6: it takes a size only where
it needs under this fraction of their best time. At one row the bytes bound the product, and
a probe's near-tie (streamed 4.44 against int16's 4.55 ms on a Zen 5) came out as a batch-1
step of 5.7 ms against 3.9 on int16."""


def size_ranges(chosen: list[int], probed: list[int]) -> tuple[tuple[int, int], ...]:
    """Row ranges [lo, hi) for the chosen probed sizes: every row count goes with the probed
    size nearest it on a log scale (rows 3 with 4, 6-7 with 8, 12-15 with 16), the last size
    with every count above it; touching ranges merged."""
    probed = sorted(probed)
    ranges: list[list[int]] = []
    for i, size in enumerate(probed):
        if size not in chosen:
            continue
        lo = 1 if i == 0 else math.ceil(math.sqrt(probed[i - 1] * size))
        hi = NEVER if i + 1 == len(probed) else math.ceil(math.sqrt(size * probed[i + 1]))
        if ranges and ranges[-1][1] == lo:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi])
    return tuple((lo, hi) for lo, hi in ranges)


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
    if path == "bf16dot":
        return lambda: cpu_bf16_dot.matmul(x, weight.bf16dot)
    if path == "dense":
        return lambda: F.linear(x, dequantized(weight))
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
COPIES = ("bfloat16", "int16", "bf16dot")
"""The extra forms a weight may keep beside its blocks, in the order a memory budget gives
them out (bfloat16 serves the many-row steps, prefill among them, where the matrix units
gain the most)."""


def measure_crossovers(weights: list[QuantizedWeight], copy_budget: int | None = None,
                       bfloat16: list[QuantizedWeight] = ()) -> dict[str, dict]:
    """Set every weight's path choice (int16_rows, crossover, bfloat16_from) and give it the
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
                            cpu_bf16_dot.SOURCE.read_text(),
                            cpu_quant.SOURCE.with_name("cpu_vector_math.h").read_text(),
                            cpu_quant.SOURCE.with_name("cpu_panel_runs.h").read_text(),
                            Path(__file__).read_text(),  # how it probes and decides
                            Path(__file__).with_name("quant_linear.py").read_text(),
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
    """The copies a weight may be given: int16 any, the bfloat16 ones only where listed (and
    bf16dot where the CPU runs its kernel)."""
    return [f for f in COPIES if f == "int16" or (id(weight) in may_bfloat16 and (
        f != "bf16dot" or cpu_bf16_dot.available()))]


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
                size = _form_bytes(w, form)
                if _takes_rows(_starts(rows, mine + [form], report), form) and size <= left:
                    mine.append(form)
                    left -= size
    for shape, same in by_shape.items():
        rows = report[_shape_name(shape)]["timings"]
        for w in same:
            mine = held.get(id(w), [])
            starts = _starts(rows, mine, report)
            # A copy handed out early can be left no rows by one handed out after it (on the
            # Zen 4, bf16dot took every row count from the bfloat16 copies: 212 MB of
            # SmolLM2 held and never read): it is not kept.
            while idle := [form for form in mine if not _takes_rows(starts, form)]:
                mine = [form for form in mine if form not in idle]
                starts = _starts(rows, mine, report)
            _drop(w, COPIES)
            _give(w, mine)
            w.crossover, w.bfloat16_from = starts["dense"], starts["bfloat16"]
            w.int16_rows, w.bf16dot_rows = starts["int16_rows"], starts["bf16dot_rows"]
        first = same[0]
        log.info("native %s: int16 at rows %s, bf16dot at %s, bfloat16 from %s, dequantise + "
                 "matmul from %s", _shape_name(shape), _ranges_text(first.int16_rows),
                 _ranges_text(first.bf16dot_rows), _rows_text(first.bfloat16_from),
                 _rows_text(first.crossover))


def _starts(rows: list[dict], copies: list[str], report: dict) -> dict:
    """A weight's path choice from its shape's timings, given the copies it holds: where
    dense and bfloat16 start (bfloat16 no earlier than the streamed timing allows), and the
    row ranges int16 and bf16dot take below them."""
    starts = starts_from_timings(rows, [p for p in PATHS if p not in COPIES or p in copies])
    dense = starts["dense"]
    bfloat16 = NEVER
    if "bfloat16" in copies and starts["bfloat16"] != NEVER:
        streamed = report.get("streamed_bfloat16", {}).get("from_rows", STREAMED_BELOW)
        bfloat16 = max(starts["bfloat16"], streamed)
    held = [p for p in STACK_PATHS if p in copies]
    sizes = stack_sizes(rows, min(dense, bfloat16), _streamed_rows(report, held), held)
    # the largest size below the float paths answers for every count up to where they start
    probed = [row["rows"] for row in rows if row["rows"] < min(dense, bfloat16)]
    return {"dense": dense, "bfloat16": bfloat16,
            **{f"{p}_rows": size_ranges(sizes.get(p, []), probed) for p in ("int16", "bf16dot")}}


def _takes_rows(starts: dict, form: str) -> bool:
    """The copy `form` serves some row count under these starts."""
    return starts["bfloat16"] != NEVER if form == "bfloat16" else bool(starts[f"{form}_rows"])


def _streamed_rows(report: dict, held: list[str]) -> list[dict]:
    """The streamed timings that time every held stack path (bf16dot's time int16 too)."""
    form = "bf16dot" if "bf16dot" in held else "int16"
    return report.get(f"streamed_{form}", {}).get("timings", [])


def _rows_text(rows: int) -> str:
    return "none" if rows == NEVER else str(rows)


def _ranges_text(ranges: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{lo}+" if hi == NEVER else f"{lo}-{hi - 1}" for lo, hi in ranges) \
        or "none"


def _form_bytes(weight: QuantizedWeight, form: str) -> int:
    """Bytes the form's copy of the weight takes (int16: 4- or 8-bit quants, the build's
    scales and the 4-bit formats' offsets, one of each per 32 weights)."""
    n = weight.out_features * weight.in_features
    if form in ("bfloat16", "bf16dot"):
        return 2 * n
    widened = weight.qtype % cpu_quant.FLOAT_SCALES + cpu_quant.FLOAT_SCALES
    scales = 2 if widened in cpu_int16.WITH_OFFSETS else 1
    scale_bytes = cpu_int16.scale_dtype().itemsize
    return n * cpu_int16.quant_bits(widened) // 8 + n // cpu_int16.BLOCK * scale_bytes * scales


def measure_streamed(weights: list[QuantizedWeight], form: str = "int16") -> dict:
    """Where `form`'s path beats the quantised paths (fused, and int16 against the bfloat16
    forms) over every weight that has that copy, taken in order, below STREAMED_BELOW rows:
    the timings (stack_sizes reads the stack paths' choice from them), and the fewest rows
    from which the form wins at every probed size (from_rows, STREAMED_BELOW if at none: the
    bfloat16 copies, which leave the stack, take rows from a start). The stack's paths are
    timed through the stack's own C dispatch (cpu_decode_stack.products): called from Python
    one weight at a time, each call's overhead had made int16 (two calls a product) look
    slower than fused at 4 and 8 rows, where in a step it is faster."""
    packed = [w for w in weights if _has_form(w, form)]
    int16_too = form != "int16" and all(w.int16 is not None for w in packed)
    rivals = ["fused", "int16"] if int16_too else ["fused"]
    rows, start = [], STREAMED_BELOW
    for m in (m for m in PROBE_ROWS if m < STREAMED_BELOW and packed):
        inputs = {w.in_features: torch.randn(m, w.in_features) for w in packed}
        runs = {p: _stack_products(packed, m, p)
                or _calling([_runner(inputs[w.in_features], w, p) for w in packed])
                for p in (*rivals, form)}
        times = probe_cache.best_times(runs, 3)
        rows.append({"rows": m, **{f"{p}_ms": round(t * 1e3, 4) for p, t in times.items()}})
    margin = STACK_MARGIN if form == "bfloat16" else 1.0
    for row in reversed(rows):  # a win at every probed size from its start on
        if row[f"{form}_ms"] >= margin * min(row[f"{p}_ms"] for p in rivals):
            break
        start = row["rows"]
    return {"from_rows": start, "timings": rows}


def _stack_products(weights: list[QuantizedWeight], rows: int, path: str):
    """The stack's own call taking every weight's product by `path`, or None (not a stack
    path, or no compiled stack)."""
    return cpu_decode_stack.products(weights, rows, path) if path in STACK_PATHS else None


def _calling(calls: list):
    return lambda: [run() for run in calls]


def _give(weight: QuantizedWeight, forms) -> None:
    if "int16" in forms and weight.int16 is None:
        weight.int16 = cpu_int16.pack(weight.data, weight.qtype, weight.in_features)
    if "bfloat16" in forms and weight.bfloat16 is None:
        weight.bfloat16 = BfloatWeight(weight.dequantize())
    if "bf16dot" in forms and weight.bf16dot is None:
        weight.bf16dot = cpu_bf16_dot.pack(weight.dequantize())


def _drop(weight: QuantizedWeight, forms) -> None:
    if "int16" in forms:
        weight.int16, weight.int16_rows = None, ()
    if "bfloat16" in forms:
        weight.bfloat16, weight.bfloat16_from = None, NEVER
    if "bf16dot" in forms:
        weight.bf16dot, weight.bf16dot_rows = None, ()


def _shape_name(shape: tuple) -> str:
    qtype, out_features, in_features = shape
    return f"type{qtype}:{out_features}x{in_features}"
