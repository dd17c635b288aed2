"""Every vector path of the CPU kernels on whatever CPU runs the suite: each kernel is built
again with the wider instruction sets switched off (`-mno-avx512f`: the AVX2 path on a CPU
with AVX-512; `-mno-avx512f -mno-avx2`: the portable C) and must compute what the machine's
own build computes. So the AVX2 code is checked on an AVX-512 CPU and the portable code on
every CPU, whichever kind CI draws."""

import random

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokstream.kernels import cpu_attention, cpu_build, cpu_int16, cpu_quant, cpu_small_ops

pytestmark = pytest.mark.skipif(cpu_quant.load() is None, reason="no C compiler here")

FLAGS = set(cpu_build.cpu_flags())
NATIVE_LANES = 16 if "avx512f" in FLAGS else 8 if {"avx2", "fma"} <= FLAGS else 0
VARIANTS = {"avx2": (("-mno-avx512f",), 8 if {"avx2", "fma"} <= FLAGS else 0),
            "portable": (("-mno-avx512f", "-mno-avx2"), 0)}
"""name -> (extra compiler flags, the vector lanes that build must report)."""


def variant(module, name: str, lanes_function: str):
    """`module`'s library built with VARIANTS[name]'s flags, checked to run the path it
    names (its lanes), and swapped in for the module's own."""
    extra, lanes = VARIANTS[name]
    library = cpu_build.Library(module.SOURCE, (*module.FLAGS, *extra),
                                module._LIBRARY.signatures)
    assert library.load() is not None
    assert getattr(library.load(), lanes_function)() == lanes
    return library


def test_the_native_builds_run_the_widest_path_the_cpu_has():
    assert cpu_quant.load().quant_vector_lanes() == NATIVE_LANES
    assert cpu_int16.load().i16_vector_lanes() == NATIVE_LANES
    assert cpu_attention.load().attention_vector_lanes() == NATIVE_LANES
    assert cpu_small_ops.load().small_ops_vector_lanes() == NATIVE_LANES


def quantised(fmt: str, n: int, k: int, seed: int):
    w = torch.from_numpy(__import__("numpy").random.default_rng(seed)
                         .normal(0, 0.1, (n, k)).astype("float32"))
    return torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[fmt])), \
        int(GGMLQuantizationType[fmt])


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_fused_product_is_the_same_on_every_path(name, fmt, monkeypatch):
    raw, qtype = quantised(fmt, 40, 96, seed=1)
    wide, wide_type = cpu_quant.with_float_scales(raw.numpy(), qtype)
    for weight, t in ((raw, qtype), (torch.from_numpy(wide), wide_type)):
        # 1-12 rows take the register paths (1-8 on AVX2), more the buffered one
        xs = [torch.randn(m, 96) for m in (1, 2, 3, 4, 5, 8, 9, 12, 13)]
        native = [cpu_quant.matmul(x, weight, t, 96) for x in xs]
        dense = cpu_quant.dequantize(weight, t, 96)
        monkeypatch.setattr(cpu_quant, "_LIBRARY", variant(cpu_quant, name, "quant_vector_lanes"))
        # dequantisation is ggml's exactly on every path; the sums differ only in order
        assert torch.equal(cpu_quant.dequantize(weight, t, 96), dense)
        for x, expected in zip(xs, native):
            got = cpu_quant.matmul(x, weight, t, 96)
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), (x.shape[0], t)
        monkeypatch.undo()


@pytest.mark.parametrize("name", ["native", *VARIANTS])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_each_of_up_to_twelve_rows_gets_the_sum_it_gets_alone(name, fmt, monkeypatch):
    """A verification chunk (a last token and its drafts, beside other decodes) multiplies its
    rows in one call: each row's product must be the very float that row gets alone, so that
    a drafted row's logits are plain decoding's."""
    if name != "native":
        monkeypatch.setattr(cpu_quant, "_LIBRARY", variant(cpu_quant, name, "quant_vector_lanes"))
    raw, qtype = quantised(fmt, 41, 96, seed=3)
    wide, wide_type = cpu_quant.with_float_scales(raw.numpy(), qtype)
    for weight, t in ((raw, qtype), (torch.from_numpy(wide), wide_type)):
        x = torch.randn(16, 96)
        alone = torch.cat([cpu_quant.matmul(x[i:i + 1], weight, t, 96) for i in range(16)])
        assert torch.allclose(alone, x @ cpu_quant.dequantize(weight, t, 96).T, atol=1e-4)
        most = 8 if name == "avx2" or NATIVE_LANES == 8 else 12  # AVX2: 1-8 in registers
        for m in range(2, most + 1):
            assert torch.equal(cpu_quant.matmul(x[:m], weight, t, 96), alone[:m]), (m, t)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_int16_product_is_the_same_on_every_path(name, fmt, monkeypatch):
    raw, qtype = quantised(fmt, 48, 96, seed=2)
    weight = cpu_int16.pack(raw, qtype, 96)
    # 1-4 rows widen the quants in registers, more rows into a panel buffer
    xs = [torch.randn(m, 96) * torch.linspace(0.1, 4, 96) for m in (11, 1, 2, 3)]
    expected = [cpu_int16.matmul(x, weight) for x in xs]
    monkeypatch.setattr(cpu_int16, "_LIBRARY", variant(cpu_int16, name, "i16_vector_lanes"))
    weight = cpu_int16.pack(raw, qtype, 96)  # each build packs 4-bit quants its own way
    # the same integer sums and the same float steps in the same order: equal, not close
    for x, want in zip(xs, expected):
        assert torch.equal(cpu_int16.matmul(x, weight), want), x.shape[0]


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(9, 3, 16), (4, 4, 16), (8, 2, 8),
                                                       (8, 2, 5)])
def test_decode_attention_is_the_same_on_every_path(name, cache_dtype, heads, kv_heads,
                                                    block_size, monkeypatch):
    rng = random.Random(heads)
    torch.manual_seed(block_size)
    num_blocks, head_dim = 80, 64
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(cache_dtype)
    # lengths under, at and past the 8 and 16 positions a vector step scores
    lengths = [1, 7, 8, 9, 16, 17, 33, 70]
    max_blocks = max(-(-n // block_size) for n in lengths)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.tensor([[free.pop() for _ in range(-(-n // block_size))]
                           + [0] * (max_blocks - -(-n // block_size)) for n in lengths])
    lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), heads, head_dim)
    expected = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    monkeypatch.setattr(cpu_attention, "_LIBRARY",
                        variant(cpu_attention, name, "attention_vector_lanes"))
    got = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.allclose(got, expected, atol=2e-6, rtol=0), (got - expected).abs().max()


@pytest.mark.parametrize("name", VARIANTS)
def test_silu_and_argmax_are_the_same_on_every_path(name, monkeypatch):
    gate_up = torch.randn(5, 2 * 100) * 6  # widths past and between whole vectors
    gate_up[0, :3] = torch.tensor([-200.0, 90.0, 0.0])  # e^x's clamps
    logits = torch.randn(6, 1000)
    logits[1, 517] = logits[1].max() + 1
    logits[2, [3, 900]] = 50.0  # a tie: the first wins
    logits[3, 640] = float("nan")  # a NaN counts as the largest
    logits[4, 999] = float("inf")  # in the scalar tail
    silu, argmax = cpu_small_ops.silu_mul(gate_up), cpu_small_ops.argmax_rows(logits)
    monkeypatch.setattr(cpu_small_ops, "_LIBRARY",
                        variant(cpu_small_ops, name, "small_ops_vector_lanes"))
    assert torch.allclose(cpu_small_ops.silu_mul(gate_up), silu, rtol=1e-6, atol=1e-6)
    assert torch.equal(cpu_small_ops.argmax_rows(logits), argmax)
    assert argmax[1:5].tolist() == [517, 3, 640, 999]


@pytest.mark.parametrize("name", [None, *VARIANTS])
def test_bfloat16_silu_is_the_float32_one_rounded_once(name, monkeypatch):
    """silu_mul over bfloat16 gives, bit for bit, the float32 kernel over the widened inputs
    cast to bfloat16 (what a prefill's down product was handed before), on this machine's
    build and every narrower one: widths past and between whole vectors, e^x's clamps, NaN,
    infinities, and products that round up, down and to even."""
    if name is not None:
        monkeypatch.setattr(cpu_small_ops, "_LIBRARY",
                            variant(cpu_small_ops, name, "small_ops_vector_lanes"))
    for inter in (1536, 100, 7):
        gate_up = (torch.randn(9, 2 * inter, generator=torch.Generator().manual_seed(inter))
                   * 6).bfloat16()
        gate_up[0, :4] = torch.tensor([-200.0, 90.0, float("nan"), float("inf")])
        gate_up[1, :2] = torch.tensor([-float("inf"), 0.0])
        want = cpu_small_ops.silu_mul(gate_up.float()).bfloat16()
        got = cpu_small_ops.silu_mul(gate_up)
        assert got.dtype == torch.bfloat16
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert same.all(), (got.float() - want.float()).abs().max()
