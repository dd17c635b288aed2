"""Native weights for the weight-format and path-choice tests: a small Q4_1 weight with its
dequantised reference, and path timings answered from a table instead of a clock."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokstream.worker import path_choice
from tokstream.worker.quant_linear import QuantizedWeight


def q4_1(out_features=32, in_features=64, seed=0):
    """(a Q4_1 QuantizedWeight of random weights, its dequantised float32 reference)"""
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 0.05, (out_features, in_features)).astype(np.float32)
    blocks = quantize(weight, GGMLQuantizationType.Q4_1)
    reference = dequantize(blocks, GGMLQuantizationType.Q4_1).astype(np.float32)
    return (QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)),
                            int(GGMLQuantizationType.Q4_1), in_features),
            torch.from_numpy(reference))


def rows_of(fastest: dict[int, str], paths) -> list[dict]:
    return [{"rows": m, **{f"{p}_ms": 1.0 if p == best else 2.0 for p in paths}}
            for m, best in fastest.items()]


def fake_timings(monkeypatch, fastest: dict[int, str]):
    """measure_crossover and measure_streamed answering from a table, not a clock."""
    def measure(weight):
        timed = [p for p in path_choice.PATHS if path_choice._has_form(weight, p)]
        return {}, rows_of(fastest, timed)

    def streamed(weights, form="int16"):
        paths = ["fused", "int16"] + ([form] if form != "int16" else [])
        small = {m: best for m, best in fastest.items() if m < path_choice.STREAMED_BELOW}
        return {"from_rows": 1, "timings": rows_of(small, paths)}

    monkeypatch.setattr(path_choice, "measure_crossover", measure)
    monkeypatch.setattr(path_choice, "measure_streamed", streamed)

@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Probe results cached in this test's own folder, never the machine's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
