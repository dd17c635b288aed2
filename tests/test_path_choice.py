"""How a native weight's paths and copies are chosen from timings (worker/path_choice.py):
the row ranges each path takes, the one-call stack's limit, the margins a copy must win by,
and the memory budget that bounds the copies (issue 28 item 1). Timings come from tables,
never a clock."""

import types

import pytest
import torch

from helpers.quant_weights import fake_timings, private_cache, q4_1  # noqa: F401
from tokstream.kernels import cpu_bf16_dot, cpu_int16, cpu_quant
from tokstream.worker import path_choice
from tokstream.worker.decode_stack import _row_limit
from tokstream.worker.onednn_linear import BfloatWeight
from tokstream.worker.quant_linear import quantized_linear

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")


def test_starts_come_from_the_timings_of_the_paths_a_weight_holds():
    paths = ["fused", "int16", "dense", "bfloat16"]
    ms = {  # rows: fused, int16, dense, bfloat16
        1: (1, 2, 9, 5), 4: (2, 3, 9, 5), 8: (4, 2, 9, 5), 16: (10, 4, 9, 5),
        32: (16, 8, 7, 5), 64: (32, 16, 6, 7), 128: (64, 32, 10, 8), 256: (128, 64, 18, 16)}
    rows = [{"rows": m, **{f"{p}_ms": t for p, t in zip(paths, times)}}
            for m, times in ms.items()]
    # dense wins once at 64, but bfloat16 (a later path) wins at every size from 32 on
    assert path_choice.starts_from_timings(rows, paths) == {
        "int16": 8, "dense": 32, "bfloat16": 128}
    # the same timings for a weight without the bfloat16 copy: dense from where it is fastest
    without = ["fused", "int16", "dense"]
    assert path_choice.starts_from_timings(rows, without) == {"int16": 8, "dense": 32}
    # and without int16 either
    assert path_choice.starts_from_timings(rows, ["fused", "dense"]) == {"dense": 16}


def test_each_stack_path_takes_the_probed_sizes_it_wins_on_its_own():
    """A near-tie lost at one size costs a path that size only (a Zen 5's crossover probe:
    int16 26% faster than fused at 1-4 rows, 3% slower at 8, faster again from 16, where one
    threshold gave fused all of 1-8); every row count goes with the probed size nearest it;
    below STREAMED_BELOW the streamed timing (every weight in order) picks, above it the
    shape's own."""
    ms = {1: (6.1, 4.5), 2: (6.1, 4.7), 4: (6.9, 6.5), 8: (11.0, 11.3), 16: (27.0, 16.0),
          32: (40.0, 25.0), 64: (80.0, 50.0), 128: (160.0, 100.0)}
    rows = [{"rows": m, "fused_ms": f, "int16_ms": i, "dense_ms": 1e3 if m < 128 else 1.0}
            for m, (f, i) in ms.items()]
    streamed = [{k: v for k, v in row.items() if k != "dense_ms"} for row in rows
                if row["rows"] < path_choice.STREAMED_BELOW]
    sizes = path_choice.stack_sizes(rows, 128, streamed, ["int16"])
    assert sizes == {"int16": [1, 2, 4, 16, 32, 64]}
    assert path_choice.size_ranges(sizes["int16"], list(ms)) == ((1, 6), (12, 91))
    # below STREAMED_BELOW the streamed timing decides: int16 slower there at 1 and 16
    slower = [dict(row, int16_ms=row["fused_ms"] + 1) if row["rows"] in (1, 16) else row
              for row in streamed]
    assert path_choice.stack_sizes(rows, 128, slower, ["int16"]) == {"int16": [2, 4, 32, 64]}
    # a bf16dot copy takes the sizes it is fastest at, int16 keeps the rest it wins
    with_bf16 = [dict(row, bf16dot_ms=row["fused_ms"] / 2 if row["rows"] >= 8 else 99.0)
                 for row in rows]
    streamed = [dict(row, bf16dot_ms=with_bf16[i]["bf16dot_ms"]) for i, row in
                enumerate(streamed)]
    assert path_choice.stack_sizes(with_bf16, 128, streamed, ["int16", "bf16dot"]) == {
        "int16": [1, 2, 4], "bf16dot": [8, 16, 32, 64]}
    # but a near-tie goes to the path that reads fewer bytes a weight (BYTES_MARGIN)
    close = [dict(row, bf16dot_ms=row["int16_ms"] * 0.95) for row in streamed]
    assert path_choice.stack_sizes(with_bf16, 128, close, ["int16", "bf16dot"]) == {
        "int16": [1, 2, 4, 16, 32], "bf16dot": [64]}
    weight = q4_1()[0]
    weight.int16 = cpu_int16.pack(weight.data, weight.qtype, 64)
    weight.int16_rows, weight.crossover = path_choice.size_ranges(sizes["int16"], list(ms)), 128
    assert [weight.path(m) for m in (1, 3, 5, 6, 8, 11, 12, 45, 90, 91, 128)] == [
        "int16", "int16", "int16", "fused", "fused", "fused", "int16", "int16", "int16",
        "fused", "dense"]


def test_a_loaded_model_takes_int16_where_it_wins(monkeypatch, private_cache):
    fake_timings(monkeypatch, {1: "int16", 2: "int16", 4: "int16", 8: "fused", 16: "int16",
                               32: "int16", 64: "dense", 128: "dense"})
    weight = q4_1()[0]
    path_choice.measure_crossovers([weight], None)
    assert weight.int16 is not None and weight.crossover == 64
    assert [weight.path(m) for m in (1, 4, 8, 16, 32, 64)] == [
        "int16", "int16", "fused", "int16", "int16", "dense"]


@pytest.mark.skipif(not cpu_bf16_dot.available(), reason="no AVX-512 BF16 here: no bf16dot")
def test_a_batch_takes_the_bf16dot_copy_where_it_wins(monkeypatch, private_cache):
    fake_timings(monkeypatch, {1: "int16", 2: "int16", 4: "fused", 8: "bf16dot",
                               16: "bf16dot", 32: "bf16dot", 64: "bfloat16", 128: "bfloat16"})
    layer, head = q4_1(seed=1)[0], q4_1(48, 64, seed=2)[0]
    path_choice.measure_crossovers([layer, head], None, [layer])
    assert layer.bf16dot is not None and layer.copy_bytes() >= 2 * 32 * 64
    assert [layer.path(m) for m in (1, 2, 4, 8, 16, 32, 63, 64)] == [
        "int16", "int16", "fused", "bf16dot", "bf16dot", "bf16dot", "bf16dot", "bfloat16"]
    # the LM head, not listed for the bfloat16 forms, keeps its quantised paths
    assert head.bf16dot is None and head.path(16) in ("fused", "int16")
    x = torch.randn(16, 64)
    assert torch.equal(quantized_linear(x, layer), cpu_bf16_dot.matmul(x, layer.bf16dot))


@pytest.mark.skipif(not cpu_bf16_dot.available(), reason="no AVX-512 BF16 here: no bf16dot")
def test_a_copy_left_no_rows_by_a_later_one_is_not_kept(monkeypatch, private_cache):
    """The bfloat16 copy, handed out first, would take 64 rows and up on its own; bf16dot,
    handed out after it, is faster there too and takes every row count from 8: the bfloat16
    copy serves none, so it is not kept (nor counted)."""
    few = {"fused": 3.0, "int16": 2.0, "bf16dot": 1.0, "dense": 50.0, "bfloat16": 50.0}
    many = {"fused": 8.0, "int16": 8.0, "bf16dot": 1.0, "dense": 6.0, "bfloat16": 2.0}
    table = {1: dict(few, int16=1.0, bf16dot=3.0), 8: few, 16: few, 32: few, 64: many,
             128: many}

    def rows_for(sizes, paths):
        return [{"rows": m, **{f"{p}_ms": table[m][p] for p in paths}} for m in sizes]

    monkeypatch.setattr(path_choice, "measure_crossover", lambda weight: ({}, rows_for(
        table, [p for p in path_choice.PATHS if path_choice._has_form(weight, p)])))
    monkeypatch.setattr(path_choice, "measure_streamed", lambda weights, form="int16": {
        "from_rows": 1, "timings": rows_for([m for m in table if m < path_choice.STREAMED_BELOW],
                                            ["fused", "int16", form])})
    layer = q4_1(seed=5)[0]
    report = path_choice.measure_crossovers([layer], None, [layer])
    assert layer.bfloat16 is None and layer.int16 is not None and layer.bf16dot is not None
    assert [layer.path(m) for m in (1, 8, 32, 64, 500)] == [
        "int16", "bf16dot", "bf16dot", "bf16dot", "bf16dot"]
    assert report["copy_bytes"] == layer.copy_bytes() == (
        path_choice._form_bytes(layer, "int16") + path_choice._form_bytes(layer, "bf16dot"))


def test_copies_stay_within_the_budget(monkeypatch, private_cache):
    fake_timings(monkeypatch, {1: "fused", 8: "int16", 16: "int16", 32: "bfloat16",
                               64: "bfloat16"})
    weights = [q4_1(seed=s)[0] for s in range(3)]
    bf16_bytes = 2 * 32 * 64
    int16_bytes = path_choice._form_bytes(weights[0], "int16")
    assert cpu_int16.pack(weights[0].data, weights[0].qtype, 64) is not None
    # room for two bfloat16 copies and one int16 copy: bfloat16 goes out first, in model
    # order, then int16 with what is left
    report = path_choice.measure_crossovers(weights, 2 * bf16_bytes + int16_bytes, weights)
    first, second, third = weights
    assert first.bfloat16 is not None and second.bfloat16 is not None
    assert first.int16 is not None and second.int16 is None and third.int16 is None
    assert [first.path(m) for m in (1, 8, 32)] == ["fused", "int16", "bfloat16"]
    assert [second.path(m) for m in (1, 8, 32)] == ["fused", "fused", "bfloat16"]
    assert third.bfloat16 is None and {third.path(m) for m in (1, 8, 32, 500)} == {"fused"}
    assert report["copy_bytes"] == sum(w.copy_bytes() for w in weights) <= \
        2 * bf16_bytes + int16_bytes
    # no budget: every weight holds both; a zero budget: none
    path_choice.measure_crossovers(weights, None, weights)
    assert all(w.bfloat16 is not None and w.int16 is not None for w in weights)
    assert [weights[2].path(m) for m in (1, 8, 32)] == ["fused", "int16", "bfloat16"]
    path_choice.measure_crossovers(weights, 0, weights)
    assert all(w.copy_bytes() == 0 and w.path(500) == "fused" for w in weights)


def test_only_the_weights_listed_may_hold_bfloat16(monkeypatch, private_cache):
    fake_timings(monkeypatch, {1: "fused", 8: "int16", 32: "bfloat16", 64: "bfloat16"})
    layer, head = q4_1(seed=1)[0], q4_1(48, 64, seed=2)[0]
    path_choice.measure_crossovers([layer, head], None, [layer])
    assert layer.path(64) == "bfloat16"
    assert head.bfloat16 is None and head.path(64) != "bfloat16"


def test_contenders_are_timed_in_turn_so_a_disturbance_falls_on_all():
    from tokstream.worker import probe_cache

    calls = []
    best = probe_cache.best_times({name: (lambda name=name: calls.append(name))
                                   for name in ("fused", "int16", "bfloat16")}, repeats=2)
    assert calls == ["fused", "int16", "bfloat16"] * 3  # a warm-up round, then two in turn
    assert set(best) == {"fused", "int16", "bfloat16"} and all(t >= 0 for t in best.values())


def test_the_one_call_stack_stops_where_any_float_path_starts():
    weights = [q4_1(seed=s)[0] for s in range(4)]
    for w in weights:
        w.crossover = 64
    layer = types.SimpleNamespace(qkv_bias=None, qkv=weights[0], o_proj=weights[1],
                                  gate_up=weights[2], down=weights[3])
    model = types.SimpleNamespace(layers=[layer])
    assert _row_limit(model) == 64
    weights[2].bfloat16, weights[2].bfloat16_from = BfloatWeight(weights[2].dequantize()), 16
    assert _row_limit(model) == 16


@pytest.mark.parametrize("bfloat16_share, start", [(0.8, path_choice.STREAMED_BELOW),
                                                   (0.6, path_choice.STREAMED_BELOW),
                                                   (0.4, 8)])
def test_bfloat16_must_beat_the_stack_by_its_margin(monkeypatch, bfloat16_share, start):
    """Below STREAMED_BELOW rows a bfloat16 copy takes rows only where it is faster than the
    quantised paths by more than what leaving the one-call decode stack costs."""
    rows_now = []
    monkeypatch.setattr(path_choice, "_runner", lambda x, w, path: (x.shape[0], path))

    def best_times(fns, repeats):
        m = rows_now[-1]
        quantised = 1.0 * m
        times = {"fused": 2 * quantised, "int16": quantised}
        # bfloat16 slower than int16 below 8 rows, the given share of it from 8 on
        times["bfloat16"] = quantised * (bfloat16_share if m >= 8 else 1.5)
        return {p: times[p] for p in fns}

    real_randn = torch.randn

    def randn(m, k):
        rows_now.append(m)
        return real_randn(m, k)

    monkeypatch.setattr(path_choice.probe_cache, "best_times", best_times)
    monkeypatch.setattr(path_choice.torch, "randn", randn)
    weight = q4_1()[0]
    weight.int16 = cpu_int16.pack(weight.data, weight.qtype, 64)
    weight.bfloat16 = BfloatWeight(weight.dequantize())
    assert path_choice.measure_streamed([weight], "bfloat16")["from_rows"] == start
    # int16 against fused keeps no margin: it stays inside the stack
    assert path_choice.measure_streamed([weight], "int16")["from_rows"] == 1

