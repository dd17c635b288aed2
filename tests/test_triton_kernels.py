"""Every Triton kernel against its torch reference, under Triton's interpreter on CPU tensors:
small shapes, random inputs with fixed seeds, outputs poisoned with NaN before the kernel so
an element it fails to write shows, and padding cases (non-power-of-two head dims and GQA
groups, empty sequences, skipped slots)."""

import random

import pytest
import torch

from helpers.triton_interpreter import interpreted_kernels  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def random_tables(rng, lengths, block_size, num_blocks):
    """Block tables of shuffled, distinct blocks covering each length, padded with -1 (a block
    id that would fault or read garbage if a kernel used it)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(1, max(-(-n // block_size) for n in lengths))
    tables = []
    for n in lengths:
        own = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(own + [-1] * (width - len(own)))
    return torch.tensor(tables)


def random_cache(kv_heads, num_blocks, block_size, head_dim, dtype):
    """Callers then set every slot no sequence owns to NaN: a kernel reading one shows."""
    return torch.randn(kv_heads, num_blocks, block_size, head_dim).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,splits", [
    (4, 2, 32, 4, 1), (6, 2, 24, 8, 4), (3, 3, 16, 16, 2)])
def test_decode_attention(interpreted_kernels, dtype, heads, kv_heads, head_dim, block_size,
                          splits):
    kernel = interpreted_kernels.paged_decode_attention
    rng = random.Random(heads * 100 + head_dim)
    torch.manual_seed(block_size + splits)
    num_blocks = 48
    # One token, a full block, a partial last block, several blocks, an empty (padded) slot.
    lengths = [1, block_size, block_size + 3, 3 * block_size + 1, 0]
    tables = random_tables(rng, lengths, block_size, num_blocks)
    used = {int(b) for b in tables.flatten() if b >= 0}
    k_cache = random_cache(kv_heads, num_blocks, block_size, head_dim, dtype)
    v_cache = random_cache(kv_heads, num_blocks, block_size, head_dim, dtype)
    for b in set(range(num_blocks)) - used:
        k_cache[:, b] = v_cache[:, b] = float("nan")
    # Positions past each sequence's end inside its own last block are garbage too.
    for i, n in enumerate(lengths):
        if n % block_size:
            last = int(tables[i, n // block_size])
            k_cache[:, last, n % block_size:] = v_cache[:, last, n % block_size:] = float("nan")
    tables = tables.clamp(min=0) if splits == 2 else tables  # padding may be any block
    lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), heads, head_dim).to(dtype)
    out = torch.full_like(q, float("nan"))
    kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.37, num_splits=splits,
                                  out=out, tile=16)
    expected = kernel.reference(q, k_cache, v_cache, tables.clamp(min=0), lens, 0.37)
    assert not out.isnan().any(), "the kernel left elements unwritten"
    assert (out[-1] == 0).all(), "an empty sequence gives zeros"
    assert torch.allclose(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0), \
        (out.float() - expected.float()).abs().max()


def test_decode_splits_agree_and_choose_sensibly(interpreted_kernels):
    """Split counts 1, 2 and 8 give the same result; the chooser fills the device, never
    splits short contexts, and returns powers of two."""
    kernel = interpreted_kernels.paged_decode_attention
    torch.manual_seed(3)
    k_cache = torch.randn(2, 40, 8, 16)
    v_cache = torch.randn(2, 40, 8, 16)
    tables = torch.randperm(40)[:36].view(3, 12)
    lens = torch.tensor([90, 7, 96])
    q = torch.randn(3, 4, 16)
    outs = [kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25,
                                          num_splits=s, tile=16) for s in (1, 2, 8)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.allclose(outs[0], outs[2],
                                                                         atol=1e-6)
    choose = kernel.choose_num_splits
    assert choose(64, 8, 4096, 132) == 1  # 512 programs already fill 132 cores
    assert choose(1, 8, 4096, 132) == 16  # 4096 tokens: at most 16 splits of 4 tiles
    assert choose(1, 8, 100, 132) == 1  # too short to split
    assert all(choose(b, 2, 8192, 132) & (choose(b, 2, 8192, 132) - 1) == 0 for b in range(1, 9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 32, 4), (3, 1, 24, 8)])
def test_prefill_attention(interpreted_kernels, dtype, heads, kv_heads, head_dim, block_size):
    kernel = interpreted_kernels.paged_prefill_attention
    rng = random.Random(heads + head_dim)
    torch.manual_seed(heads * block_size)
    num_blocks = 40
    # (cached prefix, chunk): a fresh prompt, a chunk after a partial block, a one-token
    # chunk after a long prefix, a chunk longer than one query tile.
    shapes = [(0, 7), (5, 9), (21, 1), (block_size, 37)]
    lengths = [p + c for p, c in shapes]
    tables = random_tables(rng, lengths, block_size, num_blocks).clamp(min=0)
    k_cache = random_cache(kv_heads, num_blocks, block_size, head_dim, dtype)
    v_cache = random_cache(kv_heads, num_blocks, block_size, head_dim, dtype)
    used = {int(b) for i, n in enumerate(lengths) for b in tables[i, :-(-n // block_size)]}
    for b in set(range(num_blocks)) - used:
        k_cache[:, b] = v_cache[:, b] = float("nan")
    # Chunks are laid out with a gap of 2 rows before each: rows no chunk owns stay NaN.
    starts, row = [], 0
    for _, c in shapes:
        row += 2
        starts.append(row)
        row += c
    q = torch.randn(row, heads, head_dim).to(dtype)
    out = torch.full_like(q, float("nan"))
    args = (torch.tensor(starts), torch.tensor([c for _, c in shapes]), torch.tensor(lengths),
            tables)
    kernel.paged_prefill_attention(q, k_cache, v_cache, *args, 0.29,
                                   max_query_len=max(c for _, c in shapes), out=out,
                                   block_m=16, block_n=16)
    expected = kernel.reference(q, k_cache, v_cache, *args, 0.29,
                                out=torch.full_like(q, float("nan")))
    owned = torch.zeros(row, dtype=torch.bool)
    for s, (_, c) in zip(starts, shapes):
        owned[s:s + c] = True
    assert out[~owned].isnan().all(), "the kernel wrote rows outside every chunk"
    assert not out[owned].isnan().any(), "the kernel left elements unwritten"
    assert torch.allclose(out[owned].float(), expected[owned].float(), atol=TOLERANCE[dtype],
                          rtol=0), (out[owned].float() - expected[owned].float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write(interpreted_kernels, dtype):
    kernel = interpreted_kernels.kv_cache_write
    torch.manual_seed(5)
    kv_heads, num_blocks, block_size, head_dim, heads = 2, 6, 4, 24, 4
    k_cache = torch.full((kv_heads, num_blocks, block_size, head_dim), 7.0).to(dtype)
    v_cache = torch.full_like(k_cache, -7.0)
    # k and v as views into a fused qkv output, as the model produces them.
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim).to(dtype)
    _, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    k, v = k.view(5, kv_heads, head_dim), v.view(5, kv_heads, head_dim)
    slots = torch.tensor([13, 0, -1, 23, 6])  # -1: a padded row, written nowhere
    kernel.write_kv(k_cache, v_cache, k, v, slots)
    expected_k = torch.full_like(k_cache, 7.0)
    expected_v = torch.full_like(v_cache, -7.0)
    kernel.reference(expected_k, expected_v, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert (k_cache == 7).sum() == (num_blocks * block_size - 4) * kv_heads * head_dim


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(interpreted_kernels, out_dtype, with_delta):
    kernel = interpreted_kernels.rms_norm
    torch.manual_seed(7)
    x = torch.randn(5, 72) * 3
    delta = torch.randn(5, 72).to(out_dtype) if with_delta else None
    weight = torch.rand(72) + 0.5
    expected_x = x.clone()
    expected = kernel.reference(expected_x, delta, weight, 1e-5, out_dtype)
    out = torch.full((5, 72), float("nan"), dtype=out_dtype)
    kernel.add_rms_norm(x, delta, weight, 1e-5, out_dtype, out=out)
    assert torch.allclose(x, expected_x, atol=1e-6), "the residual stream is updated in place"
    assert not out.isnan().any()
    # One rounding to out_dtype on each side: relative, like the dtype's spacing.
    assert torch.allclose(out.float(), expected.float(), atol=TOLERANCE[out_dtype],
                          rtol=TOLERANCE[out_dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary(interpreted_kernels, dtype):
    kernel = interpreted_kernels.rotary
    from tokstream.kernels.torch_ops import Rotary

    torch.manual_seed(9)
    heads, kv_heads, head_dim, tokens = 6, 2, 24, 5
    rotary = Rotary(head_dim, 64, 10000.0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    expected = qkv.clone()
    positions = torch.tensor([0, 63, 7, 7, 30])
    for buffer, apply in ((qkv, kernel.apply_rotary), (expected, kernel.reference)):
        q, k, _ = buffer.split(split, dim=-1)
        apply(q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), positions,
              rotary.cos, rotary.sin)
    v_cols = slice(split[0] + split[1], None)
    assert torch.equal(qkv[:, v_cols], expected[:, v_cols]), "values are never touched"
    assert torch.allclose(qkv.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
    assert not torch.equal(qkv[1:], expected[1:].clone().zero_()), "sanity: data is not zero"


def test_rotary_matches_the_model_layout(interpreted_kernels):
    """The reference rotates exactly as the torch model's apply_rotary (float32)."""
    from tokstream.kernels.torch_ops import Rotary, apply_rotary

    torch.manual_seed(11)
    rotary = Rotary(16, 32, 10000.0)
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    positions = torch.tensor([3, 0, 31, 9])
    cos, sin = rotary.tables(positions, torch.float32)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    interpreted_kernels.rotary.apply_rotary(q, k, positions, rotary.cos, rotary.sin)
    assert torch.allclose(q, expected_q, atol=1e-6) and torch.allclose(k, expected_k, atol=1e-6)


def test_contract_violations_are_refused(interpreted_kernels):
    decode = interpreted_kernels.paged_decode_attention.paged_decode_attention
    cache = torch.zeros(2, 4, 4, 16)
    tables, lens = torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="contract"):  # 3 query heads over 2 KV heads
        decode(torch.zeros(1, 3, 16), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="contract"):  # dtype differs from the cache
        decode(torch.zeros(1, 4, 16, dtype=torch.bfloat16), cache, cache, tables, lens, 1.0)
    strided = torch.zeros(2, 4, 16, 4).transpose(2, 3)  # head_dim not contiguous
    with pytest.raises(ValueError, match="contract"):
        decode(torch.zeros(1, 4, 16), strided, strided, tables, lens, 1.0)
    with pytest.raises(ValueError, match="contract"):
        interpreted_kernels.rms_norm.add_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16),
                                                  None, torch.ones(8), 1e-5, torch.float32)
    with pytest.raises(ValueError, match="contract"):
        interpreted_kernels.kv_cache_write.write_kv(cache, cache, torch.zeros(3, 2, 16),
                                                    torch.zeros(3, 2, 16), torch.zeros(2))
