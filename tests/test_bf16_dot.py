"""The bf16dot product (kernels/cpu_bf16_matmul.c) against the arithmetic it documents, in
float64 from the same bfloat16 roundings: tile remainders of rows and outputs, every row's
result independent of the batch around it, the shapes it refuses, and the machine's answer
to whether it runs here."""

import pytest
import torch

from tokstream.kernels import cpu_bf16_dot, cpu_build, cpu_small_ops

needs_bf16 = pytest.mark.skipif(not cpu_bf16_dot.available(),
                                reason="this CPU has no AVX-512 BF16 (avx512_bf16): the "
                                       "bf16dot path is never chosen here")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Inputs and weights rounded to bfloat16 (nearest even), products summed in float64."""
    return x.bfloat16().double() @ w.bfloat16().double().T


@needs_bf16
@pytest.mark.parametrize("m, n, k", [(1, 16, 2), (3, 48, 64), (5, 80, 96), (8, 64, 576),
                                     (13, 112, 130), (32, 192, 64), (33, 16, 1536),
                                     (9, 1008, 96), (40, 3072, 64), (515, 80, 64),
                                     (777, 1008, 96)])
def test_the_product_is_the_rounded_inputs_times_the_rounded_weights(m, n, k):
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) * 0.1
    got = cpu_bf16_dot.matmul(x, cpu_bf16_dot.pack(w))
    expected = reference(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # float32 sums of exact bfloat16 products: off by the sums' roundings only
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max() + 1e-6
    # and not the float32 product: the rounding to bfloat16 is there
    assert (got.double() - x.double() @ w.double().T).abs().max() > 1e-4


@needs_bf16
def test_a_rows_result_does_not_depend_on_the_batch():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(11, 96, generator=generator)
    weight = cpu_bf16_dot.pack(torch.randn(80, 96, generator=generator))
    batch = cpu_bf16_dot.matmul(x, weight)
    for i in (0, 3, 4, 10):
        assert torch.equal(cpu_bf16_dot.matmul(x[i:i + 1], weight)[0], batch[i])
    assert torch.equal(cpu_bf16_dot.matmul(x[4:9], weight), batch[4:9])


@needs_bf16
def test_a_prefills_rows_are_the_same_bits_as_a_decodes():
    """From 512 rows the tiles are 4 x 4 and a panel's rows are split into blocks shared out
    between the threads: every row still gets the bits it gets in a decode's 8 x 3 tiles."""
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(600, 96, generator=generator)
    weight = cpu_bf16_dot.pack(torch.randn(1008, 96, generator=generator))
    batch = cpu_bf16_dot.matmul(x, weight)
    for i in (0, 255, 256, 511, 599):
        assert torch.equal(cpu_bf16_dot.matmul(x[i:i + 32], weight)[0], batch[i])


@needs_bf16
@pytest.mark.parametrize("m, inter, k", [(1, 16, 64), (5, 48, 96), (37, 80, 576),
                                         (600, 96, 64)])
def test_the_gate_up_product_with_silu_is_the_product_then_silu_mul(m, inter, k):
    """SiLU applied in the product (two gate groups and their up groups a tile; an odd group
    left over at 48 and 80; row blocks from 512 rows) gives silu_mul's bits on the product."""
    generator = torch.Generator().manual_seed(m + inter + k)
    x = torch.randn(m, k, generator=generator)
    weight = cpu_bf16_dot.pack(torch.randn(2 * inter, k, generator=generator) * 0.2)
    expected = cpu_small_ops.silu_mul(cpu_bf16_dot.matmul(x, weight))
    assert torch.equal(cpu_bf16_dot.matmul_silu(x, weight), expected)


@needs_bf16
def test_a_gate_up_weight_needs_halves_of_whole_groups():
    with pytest.raises(ValueError, match="halves"):
        cpu_bf16_dot.matmul_silu(torch.randn(2, 64), cpu_bf16_dot.pack(torch.randn(48, 64)))


@needs_bf16
def test_rounding_is_to_nearest_even_as_torch_rounds():
    # 1 + 2^-8 is halfway between two bfloat16 values: even goes down, odd goes up
    x = torch.tensor([[1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.0e38]])
    w = torch.eye(16, 4)
    got = cpu_bf16_dot.matmul(x, cpu_bf16_dot.pack(w))[0, :4]
    assert torch.equal(got, x[0].bfloat16().float())
    # a longer row: halfway cases both ways and scaled, the largest finite values (not
    # subnormals: vdpbf16ps itself takes them as zero)
    halfway = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 2 + 2 ** -7, 1 + 5 * 2 ** -8])
    x = torch.cat([halfway, -halfway, halfway * 2 ** -100, torch.tensor([3.0e38, -3.3e38]),
                   torch.randn(34)]).reshape(1, 48)
    got = cpu_bf16_dot.matmul(x, cpu_bf16_dot.pack(torch.eye(48)))[0]
    assert torch.equal(got, x[0].bfloat16().float())


@needs_bf16
def test_shapes_it_cannot_take():
    assert cpu_bf16_dot.pack(torch.randn(24, 64)) is None  # outputs not a multiple of 16
    assert cpu_bf16_dot.pack(torch.randn(16, 63)) is None  # inputs not in pairs
    weight = cpu_bf16_dot.pack(torch.randn(16, 64))
    assert cpu_bf16_dot.matmul(torch.randn(0, 64), weight).shape == (0, 16)
    with pytest.raises(ValueError, match="float32"):
        cpu_bf16_dot.matmul(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="float32"):
        cpu_bf16_dot.matmul(torch.randn(2, 64, dtype=torch.float64), weight)


@needs_bf16
def test_it_runs_only_where_the_cpu_has_avx512_bf16():
    assert "avx512_bf16" in cpu_build.cpu_flags()


def test_a_build_without_avx512_offers_no_bf16dot_copy(monkeypatch):
    """Where the kernel cannot run (here: built with -mno-avx512f), the library says so and no
    weight is ever given the copy, whatever its timings would say."""
    if cpu_bf16_dot.load() is None:
        pytest.skip("no C compiler here")
    from tokstream.worker import path_choice, quant_linear

    narrow = cpu_build.Library(cpu_bf16_dot.SOURCE, (*cpu_bf16_dot.FLAGS, "-mno-avx512f"),
                               cpu_bf16_dot._LIBRARY.signatures)
    assert narrow.load() is not None and narrow.load().bf16_matmul_available() == 0
    weight = quant_linear.QuantizedWeight(torch.zeros(16, 40, dtype=torch.uint8), 3, 64)
    monkeypatch.setattr(cpu_bf16_dot, "_LIBRARY", narrow)
    assert not cpu_bf16_dot.available() and cpu_bf16_dot.pack(torch.randn(16, 64)) is None
    assert path_choice._forms(weight, {id(weight)}) == ["bfloat16", "int16"]
