"""The int16 product (kernels/cpu_int16_matmul.c) against the arithmetic it documents, done
here in float64 from the same int16 inputs: each GGUF format, remainders of its row and
output tiles, every row's result independent of the batch around it, and the portable C
path equal to the vector one."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokstream.kernels import cpu_build, cpu_int16, cpu_quant

pytestmark = pytest.mark.skipif(cpu_int16.load() is None, reason="no C compiler here")


def blocks(fmt: str, n: int, k: int, seed: int = 0):
    """Random (n, k) weights in GGUF blocks of fmt, and their float32 dequantisation."""
    qtype = GGMLQuantizationType[fmt]
    w = np.random.default_rng(seed).normal(0, 0.1, (n, k)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(w, qtype))
    return torch.from_numpy(raw), int(qtype), torch.from_numpy(dequantize(raw, qtype))


def reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it (per row, per 32 inputs: scale max|x| / 32767,
    nearest even), times the file's weights, in float64."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    top = b.abs().amax(-1, keepdim=True)
    scale = torch.where(top > 0, top / 32767, torch.ones_like(top))
    rounded = torch.round(b * (1 / scale)) * scale
    return rounded.reshape(m, k).double() @ dense.double().T


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m, n, k", [(1, 16, 64), (5, 48, 96), (9, 80, 64), (4, 32, 128),
                                     (24, 1008, 64), (40, 3072, 32)])
def test_the_product_is_the_rounded_inputs_times_the_files_weights(fmt, m, n, k):
    raw, qtype, dense = blocks(fmt, n, k)
    weight = cpu_int16.pack(raw, qtype, k)
    x = torch.randn(m, k) * torch.linspace(0.1, 4, k)  # uneven blocks, as activations are
    got = cpu_int16.matmul(x, weight)
    expected = reference(x, dense)
    assert got.shape == (m, n)
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    # and close to the float32 product of the unrounded inputs
    exact = x.double() @ dense.double().T
    assert (got.double() - exact).abs().max() <= 1e-3 * exact.abs().max()


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [16, 48, 80, 144])
def test_a_rows_result_does_not_depend_on_the_batch(fmt, n):
    """Products of few rows widen the quants in registers (1-4 rows, or up to 16 four at a
    time on AVX2), larger ones into a panel buffer: each row's result is the same bits either
    way, whatever the groups and rows left over."""
    raw, qtype, _ = blocks(fmt, n, 96, seed=2)
    weight = cpu_int16.pack(raw, qtype, 96)
    x = torch.randn(21, 96)
    batch = cpu_int16.matmul(x, weight)
    for i in (0, 5, 10, 20):
        assert torch.equal(cpu_int16.matmul(x[i:i + 1], weight)[0], batch[i])
    for rows in (2, 3, 4, 6, 9, 16):
        assert torch.equal(cpu_int16.matmul(x[1:1 + rows], weight), batch[1:1 + rows])


def test_the_four_bit_formats_take_four_bits_a_quant():
    for fmt, bits in (("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)):
        raw, qtype, _ = blocks(fmt, 32, 64)
        weight = cpu_int16.pack(raw, qtype, 64)
        assert weight.bits == bits and weight.quants.numel() == 32 * 64 * bits // 8


def test_scales_are_kept_exactly_or_not_packed():
    """Where the build keeps scales as float16 (the AVX-512 and AVX2 builds) each is the
    file's float16 exactly; a float-scale block whose scale float16 cannot hold gets no copy
    (callers keep the fused path), never a rounded one."""
    raw, qtype, _ = blocks("Q4_1", 16, 64)
    widened, wide_type = cpu_quant.with_float_scales(raw.numpy(), qtype)
    weight = cpu_int16.pack(raw, qtype, 64)
    assert weight.scales.dtype == cpu_int16.scale_dtype() == weight.offsets.dtype
    blocks_f = widened.reshape(16, 2, 24)  # (rows, blocks, {float d, m; 16 quant bytes})
    d = blocks_f[:, :, :4].copy().view(np.float32).reshape(-1)
    assert sorted(weight.scales.float().tolist()) == sorted(d.tolist())
    blocks_f[0, 0, :4] = np.array([0.1], dtype=np.float32).view(np.uint8)  # not a float16
    repacked = cpu_int16.pack(torch.from_numpy(widened), wide_type, 64)
    assert (repacked is None) == (cpu_int16.scale_dtype() == torch.float16)


def test_zero_inputs_and_no_rows():
    raw, qtype, _ = blocks("Q4_1", 16, 64)
    weight = cpu_int16.pack(raw, qtype, 64)
    assert torch.equal(cpu_int16.matmul(torch.zeros(3, 64), weight), torch.zeros(3, 16))
    assert cpu_int16.matmul(torch.empty(0, 64), weight).shape == (0, 16)


def test_unsupported_shapes_get_no_copy():
    raw, qtype, _ = blocks("Q4_1", 8, 64)
    assert cpu_int16.pack(raw, qtype, 64) is None  # outputs not a multiple of 16
    with pytest.raises(ValueError):
        cpu_int16.matmul(torch.randn(2, 32), cpu_int16.pack(*blocks("Q4_1", 16, 64)[:2], 64))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_the_portable_path_computes_what_the_vector_path_does(tmp_path, monkeypatch, fmt, m):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_int16.load().i16_vector_lanes() > 0 or pytest.skip("no vector path here")
    raw, qtype, _ = blocks(fmt, 80, 64, seed=4)
    x = torch.randn(m, 64)
    vector = cpu_int16.matmul(x, cpu_int16.pack(raw, qtype, 64))
    flags = (*cpu_int16.FLAGS, "-mno-avx512f", "-mno-avx2")
    portable = cpu_build.Library(cpu_int16.SOURCE, flags, cpu_int16._LIBRARY.signatures)
    assert portable.load() is not None and portable.load().i16_vector_lanes() == 0
    monkeypatch.setattr(cpu_int16, "_LIBRARY", portable)
    # each build packs its own way; the same integer sums and float steps in the same order
    assert torch.equal(cpu_int16.matmul(x, cpu_int16.pack(raw, qtype, 64)), vector)
