"""The compiled CPU decode-attention kernel against the torch reference."""

import random

import pytest
import torch

from tokstream.kernels import cpu_attention
from tokstream.worker.attention import AttentionMetadata, _decode_attention_reference

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="no C compiler here")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 32, 8), (4, 1, 128, 16)])
def test_kernel_matches_reference(dtype, atol, heads, kv_heads, head_dim, block_size):
    rng = random.Random(heads * head_dim)
    torch.manual_seed(heads + block_size)
    num_blocks, num_seqs = 64, 7
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(dtype)
    # Lengths cover one token, exact block multiples and partial last blocks.
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 5, 2 * block_size, 40]
    max_blocks = max(-(-n // block_size) for n in lengths)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = []
    for n in lengths:
        own = [blocks.pop() for _ in range(-(-n // block_size))]
        tables.append(own + [0] * (max_blocks - len(own)))
    tables = torch.tensor(tables)
    lens = torch.tensor(lengths)
    q = torch.randn(num_seqs, heads, head_dim).to(dtype)
    bias = torch.zeros(num_seqs, max_blocks * block_size).masked_fill_(
        torch.arange(max_blocks * block_size)[None] >= lens[:, None], float("-inf"))
    meta = AttentionMetadata(None, num_seqs, tables, bias, [])
    scale = head_dim ** -0.5
    expected = _decode_attention_reference(q, k_cache, v_cache, meta, scale)
    got = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.allclose(got.float(), expected.float(), atol=atol, rtol=0), \
        (got.float() - expected.float()).abs().max()


def test_kernel_ignores_what_lies_past_each_sequence():
    """Slots past a sequence's length (stale data, NaN) never leak into its output."""
    k_cache = torch.randn(1, 4, 4, 8)
    v_cache = torch.randn(1, 4, 4, 8)
    tables, lens, q = torch.tensor([[2, 3]]), torch.tensor([5]), torch.randn(1, 1, 8)
    before = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3)
    k_cache[0, 3, 1:] = float("nan")
    v_cache[0, 3, 1:] = float("nan")
    k_cache[0, 0] = float("nan")
    after = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3)
    assert torch.equal(before, after)
