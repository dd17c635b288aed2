"""A weight format per step size (issue 28): the bfloat16 copies native weights keep for
many-row products and what a layer does with them, the dtype and KV cache choices, and the
safe questions asked before any bfloat16 or AMX product (matrix_units). How the copies' rows
are chosen from timings is tests/test_path_choice.py."""

import pytest
import torch

from helpers.quant_weights import fake_timings, private_cache, q4_1  # noqa: F401
from tokstream.config import CacheConfig, EngineConfig
from tokstream.errors import UserInputError
from tokstream.kernels import cpu_bf16_dot, cpu_build, cpu_quant
from tokstream.model.source import resolve_model
from tokstream.worker import dtype_choice, matrix_units, path_choice
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

