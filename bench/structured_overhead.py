"""What structured outputs add to a decode step: the sampler's time for 32 rows constrained by
a JSON schema (llguidance masks, one per row, then sampling) against 32 free rows, on
SmolLM2's tokenizer and vocabulary, with random logits, over the steps of a whole generation.

    .venv/bin/python bench/structured_overhead.py   # -> bench/results/structured_overhead.json

Side by side in one run; the CPU model and its flags and the load average are recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ROWS, STEPS = 32, 40


def worker_allocator() -> None:
    """The worker's malloc settings (engine/rank_start.py WORKER_ENV), applied to this process:
    without them each step's large buffers are mapped and unmapped, and that is measured."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


def main() -> None:
    worker_allocator()
    sys.path.insert(0, str(ROOT))
    from tokstream.kernels import cpu_build
    from tokstream.model.source import resolve_model
    from tokstream.sampling_params import SamplingParams
    from tokstream.structured import StructuredOutput
    from tokstream.text.tokenizer import load_tokenizer
    from tokstream.worker.grammar import Grammars
    from tokstream.engine.messages.worker import NewRequestData
    from tokstream.worker.sampler import SamplingRow, sample

    source = resolve_model("smollm2")
    tokenizer = load_tokenizer(source)
    vocab = source.config.vocab_size
    grammars = Grammars(lambda: tokenizer.backend.to_str(), vocab, source.config.eos_token_ids)
    grammar = SamplingParams(structured=StructuredOutput("json_schema",
                                                         json.dumps(SCHEMA))).grammar
    load = os.getloadavg()[0]
    started = time.perf_counter()
    grammars.constraint(grammar)
    first_ms = (time.perf_counter() - started) * 1e3
    generator = torch.Generator().manual_seed(0)
    results = {}
    for label in ("free", "json_schema"):
        constraints = [grammars.constraint(grammar) if label != "free" else None
                       for _ in range(ROWS)]
        outputs: list[list[int]] = [[] for _ in range(ROWS)]
        times = []
        for step in range(STEPS):
            logits = torch.randn(ROWS, vocab, generator=generator) * 4
            rows = [SamplingRow(NewRequestData(str(i), SamplingParams(), seed=i), step,
                                output_ids=outputs[i], constraint=constraints[i])
                    for i in range(ROWS)]
            begin = time.perf_counter()
            tokens = sample(logits, rows)
            times.append(time.perf_counter() - begin)
            for i, token in enumerate(tokens):
                outputs[i] = outputs[i] + [token]
        results[label] = {"sample_ms_median": round(statistics.median(times) * 1e3, 3),
                          "sample_ms_p90": round(sorted(times)[int(0.9 * STEPS)] * 1e3, 3)}
    flags = cpu_build.cpu_flags()
    out = {
        "machine": {"cpu_model": cpu_build.cpu_model(), "cores": os.cpu_count(),
                    "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                                  if f in flags], "load_average_before": load},
        "rows": ROWS, "steps": STEPS, "schema": SCHEMA,
        "first_constraint_ms": round(first_ms, 1),
        "results": results,
        "added_ms_per_step": round(results["json_schema"]["sample_ms_median"]
                                   - results["free"]["sample_ms_median"], 3)}
    path = ROOT / "bench" / "results" / "structured_overhead.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
