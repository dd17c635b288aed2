"""The compiled CPU decode-attention kernel against the torch reference."""

import random

import pytest
import torch

from tokstream.kernels import cpu_attention
from tokstream.worker.attention import AttentionMetadata, _decode_attention_reference

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="no C compiler here")


@pytest.mark.parametrize("dtype,cache_dtype,atol", [
    (torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2),
    # float32 queries over a float16 cache: against the reference on the same float16 values
    (torch.float32, torch.float16, 1e-5)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 32, 8), (4, 1, 128, 16), (8, 2, 64, 8),
    (4, 4, 64, 16), (6, 3, 64, 4)])
def test_kernel_matches_reference(dtype, cache_dtype, atol, heads, kv_heads, head_dim,
                                  block_size):
    rng = random.Random(heads * head_dim)
    torch.manual_seed(heads + block_size)
    num_blocks, num_seqs = 64, 7
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(cache_dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim).to(cache_dtype)
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


def test_a_cache_in_another_dtype_is_refused_not_misread():
    q = torch.randn(1, 2, 16)
    cache = torch.randn(2, 2, 4, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="no kernel"):
        cpu_attention.paged_decode_attention(q, cache, cache, torch.tensor([[0]]),
                                             torch.tensor([3]), 0.25)


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


# ---- the fused elementwise steps (cpu_small_ops.c) against the torch they replace ----------

from tokstream.kernels import cpu_small_ops  # noqa: E402
from tokstream.kernels.torch_ops import Rotary, apply_rotary, rms_norm, silu_mul  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(tokens, with_delta):
    x, delta, weight = torch.randn(tokens, 576), torch.randn(tokens, 576), torch.randn(576)
    expected_x = x + delta if with_delta else x.clone()
    expected = rms_norm(expected_x, weight, 1e-5)
    got = cpu_small_ops.add_rms_norm(x, delta if with_delta else None, weight, 1e-5)
    assert torch.allclose(x, expected_x, atol=1e-6)  # the residual is updated in place
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("tokens", [1, 9])
def test_rotary_in_place_matches_torch(tokens):
    heads, kv_heads, head_dim = 9, 3, 64
    rope = Rotary(head_dim, 256, 100000.0)
    positions = torch.randint(0, 256, (tokens,))
    cos, sin = rope.tables(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    before_v = qkv[:, (heads + kv_heads) * head_dim:].clone()
    cpu_small_ops.rotary(q, k, cos, sin)
    assert torch.allclose(q, expected_q, atol=1e-5) and torch.allclose(k, expected_k, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], before_v)  # v untouched


@pytest.mark.parametrize("inter", [1536, 40, 7])
def test_silu_mul_matches_torch(inter):
    gate_up = torch.randn(5, 2 * inter) * 6  # wide enough to reach both ends of the sigmoid
    gate_up[0, 0], gate_up[0, 1] = 100.0, -100.0
    expected = silu_mul(gate_up)
    got = cpu_small_ops.silu_mul(gate_up)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("tokens", [1, 4])
def test_the_backend_rotates_qkv_views_in_place(tokens):
    """The model's q and k are views into one qkv row (with one token torch gives them
    different row strides); the backend takes the C path for both and matches torch."""
    from tokstream.worker.backend import TorchBackend

    rope = Rotary(64, 256, 100000.0)
    tables = TorchBackend.rope_tables(rope, torch.arange(tokens) + 7, torch.float32)
    qkv = torch.randn(tokens, 15 * 64)
    q, k, _ = qkv.split((9 * 64, 3 * 64, 3 * 64), dim=-1)
    q, k = q.view(tokens, 9, 64), k.view(tokens, 3, 64)
    expected_q, expected_k = apply_rotary(q, *tables), apply_rotary(k, *tables)
    got_q, got_k = TorchBackend.rotate(q, k, tables)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.allclose(got_q, expected_q, atol=1e-5)
    assert torch.allclose(got_k, expected_k, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_kv_writes_match_torch(tokens, cache_dtype, monkeypatch):
    from tokstream.worker import attention
    from tokstream.worker.attention import write_kv
    from tokstream.worker.backend import TorchBackend

    qkv = torch.randn(tokens, 15 * 64)
    _, k, v = qkv.split((9 * 64, 3 * 64, 3 * 64), dim=-1)
    k, v = k.view(tokens, 3, 64), v.view(tokens, 3, 64)
    slots = torch.randperm(8 * 16)[:tokens]
    expected = [torch.zeros(3, 8, 16, 64, dtype=cache_dtype) for _ in range(2)]
    got = [torch.zeros(3, 8, 16, 64, dtype=cache_dtype) for _ in range(2)]
    write_kv(*expected, k, v, slots)  # torch rounds each value to float16 once, as C must
    monkeypatch.setattr(attention, "write_kv", None)  # the C path must be the one taken
    TorchBackend.write_kv(*got, k, v, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[0].any()


@pytest.mark.parametrize("rows,cols", [(32, 49152), (1, 49152), (5, 77), (3, 15)])
def test_argmax_rows_matches_torch_with_ties_nans_and_infinities(rows, cols):
    logits = torch.randn(rows, cols)
    if rows > 1:
        logits[1, cols // 3] = logits[1, cols - 1] = 50.0  # a tie: the first index wins
    if rows > 2:
        logits[2, :] = float("-inf")  # all -inf: index 0
    if rows > 3:
        logits[3, cols - 2] = float("nan")  # NaN counts as the largest
        logits[3, cols - 1] = float("nan")
    logits[0, cols - 1] = 1e9  # the largest in the tail, past the last full vector
    assert torch.equal(cpu_small_ops.argmax_rows(logits), logits.argmax(dim=-1))


def test_greedy_sampling_takes_the_c_argmax(monkeypatch):
    from tokstream.engine.messages.worker import NewRequestData
    from tokstream.sampling_params import SamplingParams
    from tokstream.worker import sampler

    logits = torch.randn(4, 1000)
    greedy = NewRequestData("r", SamplingParams(temperature=0.0), 0)
    rows = [sampler.SamplingRow(greedy, 0) for _ in range(4)]
    expected = logits.argmax(dim=-1).tolist()
    calls = []
    real = cpu_small_ops.argmax_rows
    monkeypatch.setattr(cpu_small_ops, "argmax_rows", lambda x: calls.append(x) or real(x))
    assert sampler.sample(logits, rows) == expected
    assert calls  # the kernel, not torch, answered
