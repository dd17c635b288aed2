"""A weight format per step size (issue 28): the bfloat16 copies native weights keep for
many-row products, how their rows are chosen from timings, the memory budget that bounds the
copies, and the safe questions asked before any bfloat16 or AMX product (matrix_units)."""

import types

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokstream.config import CacheConfig, EngineConfig
from tokstream.errors import UserInputError
from tokstream.kernels import cpu_bf16_dot, cpu_build, cpu_int16, cpu_quant
from tokstream.model.source import resolve_model
from tokstream.worker import dtype_choice, matrix_units, path_choice
from tokstream.worker.decode_stack import _row_limit
from tokstream.worker.dtype_choice import has_native_bf16
from tokstream.worker import model as model_module
from tokstream.config import ModelConfig
from tokstream.kernels.torch_ops import Rotary
from tokstream.worker.attention import AttentionMetadata
from tokstream.worker.backend import TorchBackend
from tokstream.worker.onednn_linear import BfloatWeight
from tokstream.worker.prefill_attention import PrefillSeq
from tokstream.worker.quant_linear import QuantizedWeight, quantized_linear

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")


def q4_1(out_features=32, in_features=64, seed=0):
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 0.05, (out_features, in_features)).astype(np.float32)
    blocks = quantize(weight, GGMLQuantizationType.Q4_1)
    reference = dequantize(blocks, GGMLQuantizationType.Q4_1).astype(np.float32)
    return (QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)),
                            int(GGMLQuantizationType.Q4_1), in_features),
            torch.from_numpy(reference))


def test_the_bfloat16_path_takes_the_rows_from_its_start():
    weight, reference = q4_1()
    weight.bfloat16 = BfloatWeight(weight.dequantize())
    weight.crossover, weight.bfloat16_from = 4, 8
    assert [weight.path(m) for m in (1, 4, 7, 8, 300)] == [
        "fused", "dense", "dense", "bfloat16", "bfloat16"]
    assert weight.float_from == 4
    x = torch.randn(9, 64)
    got = quantized_linear(x, weight)
    exact = (x.double() @ reference.double().T)
    rounded = x.bfloat16().double() @ reference.bfloat16().double().T
    # the bfloat16 product: inputs and weights rounded to bfloat16, sums kept wide
    assert got.dtype == torch.float32 and got.shape == (9, 32)
    assert (got.double() - rounded).abs().max() < 1e-2
    assert 0 < (got.double() - exact).abs().max() < 5e-2
    weight.bfloat16 = None  # without the copy the start means nothing
    assert weight.path(300) == "dense" and weight.float_from == 4


@pytest.mark.skipif(not has_native_bf16(), reason="no native bfloat16: no bfloat16 copies")
def one_layer(gate_up: QuantizedWeight, down: QuantizedWeight):
    """A decoder layer (hidden 64, inter 96) with these native MLP weights, and its ops."""
    config = ModelConfig(name="t", vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position=64)
    layer = model_module.DecoderLayer(config, 1, torch.float32)
    g = torch.Generator().manual_seed(0)
    for name in ("input_norm", "post_norm", "qkv", "o_proj"):
        getattr(layer, name).copy_(torch.randn(getattr(layer, name).shape, generator=g) * 0.2)
    for name, w in (("gate_up", gate_up), ("down", down)):
        delattr(layer, name)  # as load_weights puts native blocks in the parameter's place
        setattr(layer, name, w)
    return layer, TorchBackend()


def run_layer(layer, ops, tokens: int) -> torch.Tensor:
    """The layer's forward pass over one prompt of `tokens` tokens."""
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    blocks = max(2, -(-tokens // 16))
    caches = [torch.zeros(2, blocks, 16, 16) for _ in range(2)]
    meta = AttentionMetadata(torch.arange(tokens), 0, None, None,
                             [PrefillSeq(0, tokens, tokens, torch.arange(blocks))])
    rope = Rotary(16, 64, 10000.0).tables(torch.arange(tokens), torch.float32)
    return layer(x, rope, caches, meta, lambda t: t, ops)


def test_a_layers_mlp_on_the_bfloat16_path_is_the_same_without_the_casts(monkeypatch):
    """gate/up hands its bfloat16 product straight to SiLU·up and on to down (narrow), no
    float32 tensor between: the layer's output is bit for bit what widening gate/up's product
    and rounding SiLU·up back gave; under the bfloat16 start, or with down off its bfloat16
    path, nothing changes."""
    gate_up, _ = q4_1(192, 64, seed=1)
    down, _ = q4_1(64, 96, seed=2)
    for w in (gate_up, down):
        w.bfloat16 = BfloatWeight(w.dequantize())
        w.crossover, w.bfloat16_from = 1 << 40, 8
    layer, ops = one_layer(gate_up, down)
    seen = []
    real_silu = ops.silu_mul
    monkeypatch.setattr(ops, "silu_mul", lambda x: seen.append(x.dtype) or real_silu(x))

    def forward(tokens: int, narrow_ok: bool) -> torch.Tensor:
        layer.linear = model_module.linear if narrow_ok else (
            lambda x, w, b=None, narrow=False: model_module.linear(x, w, b))
        return run_layer(layer, ops, tokens)

    seen.clear()
    wide = forward(16, narrow_ok=False)
    assert seen == [torch.float32]
    seen.clear()
    narrow = forward(16, narrow_ok=True)
    assert seen == [torch.bfloat16]
    assert narrow.dtype == torch.float32 and torch.equal(narrow, wide)
    seen.clear()
    forward(4, narrow_ok=True)  # under bfloat16_from: the quantised paths, float32 throughout
    assert seen == [torch.float32]
    down.bfloat16_from = 1 << 40  # down off its bfloat16 path: its input stays float32
    seen.clear()
    wide = forward(16, narrow_ok=False)
    seen.clear()
    assert torch.equal(forward(16, narrow_ok=True), wide) and seen == [torch.float32]


def rows_of(fastest: dict[int, str], paths) -> list[dict]:
    return [{"rows": m, **{f"{p}_ms": 1.0 if p == best else 2.0 for p in paths}}
            for m, best in fastest.items()]


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
def test_a_gate_up_product_on_bf16dot_applies_silu_in_the_product(monkeypatch, private_cache):
    """Where the [gate; up] weight's path is bf16dot, a layer takes SiLU(gate) * up out of the
    product itself (the same bits as the product then silu_mul); on any other path the
    product is taken, then silu_mul."""
    fake_timings(monkeypatch, {1: "int16", 2: "int16", 4: "fused", 8: "bf16dot",
                               16: "bf16dot", 32: "bf16dot", 64: "bfloat16", 128: "bfloat16"})
    gate_up = q4_1(192, 64, seed=3)[0]
    path_choice.measure_crossovers([gate_up], None, [gate_up])
    layer, ops = one_layer(gate_up, q4_1(64, 96, seed=4)[0])
    fused, silu = [], []
    monkeypatch.setattr(layer, "silu_product",
                        lambda x, w: fused.append(1) or model_module.silu_product(x, w))
    monkeypatch.setattr(ops, "silu_mul", lambda x: silu.append(1) or TorchBackend.silu_mul(x))
    for tokens, in_product in ((16, True), (4, False), (64, False)):
        fused.clear(), silu.clear()
        run_layer(layer, ops, tokens)
        assert (len(fused), len(silu)) == ((1, 0) if in_product else (0, 1))
        x = torch.randn(tokens, 64)
        if in_product:
            assert torch.equal(model_module.silu_product(x, gate_up),
                               TorchBackend.silu_mul(quantized_linear(x, gate_up)))


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
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


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


def test_tile_permission_is_asked_and_its_answer_believed():
    assert matrix_units.request_tile_permission(["avx512f", "avx512_bf16"]) == "absent"
    amx = ["avx512f", "amx_tile", "amx_bf16", "amx_int8"]
    calls = []

    def refusing(*args):
        calls.append(args)
        return -1

    assert matrix_units.request_tile_permission(amx, refusing) == "refused"
    assert calls[0][1].value == matrix_units.ARCH_REQ_XCOMP_PERM

    def granting(number, code, arg):
        if code.value == matrix_units.ARCH_GET_XCOMP_PERM:
            arg._obj.value = 1 << matrix_units.XFEATURE_XTILEDATA
        return 0

    assert matrix_units.request_tile_permission(amx, granting) == "granted"

    def saying_yes_but_not_granting(number, code, arg):
        return 0  # the permission mask stays empty

    assert matrix_units.request_tile_permission(amx, saying_yes_but_not_granting) == "refused"
    # this machine's real answer: never an exception, one of the three
    assert matrix_units.request_tile_permission() in ("granted", "refused", "absent")


def test_a_probe_that_dies_of_an_illegal_instruction_turns_bfloat16_off(monkeypatch,
                                                                        private_cache):
    monkeypatch.setattr(matrix_units, "has_native_bf16", lambda flags=None: True)
    sigill = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    assert not matrix_units.bfloat16_products_work(lambda: matrix_units._run_probe(sigill))
    # cached per machine: not asked again
    assert not matrix_units.bfloat16_products_work(lambda: pytest.fail("probed twice"))


def test_the_real_probe_runs_a_bfloat16_product(private_cache):
    works, detail = matrix_units._run_probe()
    assert works, detail


def test_weights_auto_keeps_both_forms_where_the_copies_fit(monkeypatch):
    smollm2 = resolve_model("smollm2")
    monkeypatch.setattr(dtype_choice, "choose_cpu_dtype", lambda config: "bfloat16")
    monkeypatch.setattr(dtype_choice, "native_faster_than", lambda dtype, config: False)
    fits = 2 * smollm2.config.num_params
    assert dtype_choice.resolve_weights("auto", "auto", smollm2, "cpu", fits) == (
        "native", "float32")
    # too little memory for the copies: the one format that served the probe's mix best
    assert dtype_choice.resolve_weights("auto", "auto", smollm2, "cpu", fits - 1) == (
        "dequantized", "bfloat16")


def test_an_explicit_dtype_is_the_caches_too(monkeypatch):
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: ["avx2", "f16c"])
    resolve = dtype_choice.resolve_kv_cache_dtype
    assert resolve("auto", "float32", "cpu", explicit_dtype=True) == "float32"
    assert resolve("auto", "float32", "cpu", explicit_dtype=False) == "float16"
    assert resolve("float16", "float32", "cpu", explicit_dtype=True) == "float16"


def test_cpu_kinds_name_the_vendor_model_and_matrix_class():
    info = ("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            "flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_build.cpu_kind(info) == "intel-f6m143-amx"
    assert cpu_build.cpu_kind(info.replace(" amx_tile amx_bf16", "")) == "intel-f6m143-bf16"
    zen = "vendor_id : AuthenticAMD\ncpu family : 25\nmodel : 17\nflags : avx2 avx512f\n"
    assert cpu_build.cpu_kind(zen) == "amd-f25m17-avx512"
    assert cpu_build.cpu_kind("") == "cpu-f?m?-base"


def test_native_bfloat16_is_read_from_the_cpu_flags():
    """oneDNN says 'supported' where bfloat16 is only emulated; the flags say what is real."""
    assert not has_native_bf16(["avx512f", "avx512_vnni", "avx2"])
    assert has_native_bf16(["avx512f", "avx512_bf16"])
    assert has_native_bf16(["amx_bf16", "amx_tile"])


def test_kv_cache_dtype_choices(monkeypatch):
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: ["avx2", "f16c"])
    resolve = dtype_choice.resolve_kv_cache_dtype
    assert resolve("auto", "float32", "cpu") == "float16"
    assert resolve("auto", "bfloat16", "cpu") == "bfloat16"
    assert resolve("auto", "float32", "cuda") == "float32"
    assert resolve("float32", "float32", "cpu") == "float32"
    assert resolve("float16", "float32", "cpu") == "float16"
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: ["avx2"])
    assert resolve("auto", "float32", "cpu") == "float32"  # no float16 conversions in hardware
    for kv, serving, device in [("bfloat16", "float32", "cpu"), ("float16", "bfloat16", "cpu"),
                                ("float16", "float32", "cuda")]:
        with pytest.raises(UserInputError, match="KV cache"):
            resolve(kv, serving, device)
    with pytest.raises(UserInputError, match="kv_cache_dtype"):
        EngineConfig(cache=CacheConfig(kv_cache_dtype="int8"))


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
