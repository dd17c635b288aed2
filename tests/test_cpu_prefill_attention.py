"""The C prefill-attention kernel against torch's path: every dtype pair it takes, chunks with
and without a cached prefix, lengths off its tiles, blocks anywhere in the pool; and the
choice between the two paths."""

from __future__ import annotations

import pytest
import torch

from tokstream.kernels import cpu_prefill_attention
from tokstream.worker import prefill_attention as pa
from tokstream.worker.prefill_attention import PrefillSeq, prefill_attention_torch

pytestmark = pytest.mark.skipif(cpu_prefill_attention.load() is None,
                                reason="no C compiler for the CPU kernel")

PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
         (torch.float32, torch.float16)]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
"""float32: summation order only; bfloat16: one rounding of the output (values ~1)."""


def case(q_dtype, cache_dtype, context, query_len, num_heads=9, num_kv_heads=3, head_dim=64,
         block_size=16, seed=0):
    """A pool with the sequence's blocks shuffled among others, its last query_len keys and
    values (the chunk's) read back from the pool as the model writes them first."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size)
    pool = blocks + 7
    k_cache, v_cache = (torch.randn(num_kv_heads, pool, block_size, head_dim, generator=g)
                        .to(cache_dtype) for _ in range(2))
    table = torch.randperm(pool, generator=g)[:blocks]
    q = torch.randn(query_len, num_heads, head_dim, generator=g).to(q_dtype)
    positions = torch.arange(context - query_len, context)
    slots = table[positions // block_size] * block_size + positions % block_size
    k, v = (c.view(num_kv_heads, -1, head_dim)[:, slots].transpose(0, 1).to(q_dtype)
            for c in (k_cache, v_cache))
    return q, k, v, k_cache, v_cache, PrefillSeq(0, query_len, context, table)


@pytest.mark.parametrize("q_dtype,cache_dtype", PAIRS)
@pytest.mark.parametrize("context,query_len", [(1, 1), (5, 5), (64, 64), (100, 37), (130, 1),
                                               (200, 200), (777, 300), (1000, 128)])
def test_kernel_equals_torch(q_dtype, cache_dtype, context, query_len):
    q, k, v, k_cache, v_cache, seq = case(q_dtype, cache_dtype, context, query_len)
    expected = prefill_attention_torch(q, k, v, k_cache, v_cache, seq, 0.125)
    got = cpu_prefill_attention.paged_prefill_attention(q, k_cache, v_cache, seq.block_table,
                                                        context, 0.125)
    assert got.dtype == q_dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=0,
                               atol=TOLERANCE[q_dtype])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(4, 4, 128, 8), (8, 2, 80, 32), (6, 1, 16, 16)])
def test_other_shapes(num_heads, num_kv_heads, head_dim, block_size):
    """No grouping, head_dim past one 64-wide pass (128) and off it (80), one kv head, other
    block sizes."""
    q, k, v, k_cache, v_cache, seq = case(torch.float32, torch.float32, 333, 90, num_heads,
                                          num_kv_heads, head_dim, block_size)
    expected = prefill_attention_torch(q, k, v, k_cache, v_cache, seq, head_dim ** -0.5)
    got = cpu_prefill_attention.paged_prefill_attention(q, k_cache, v_cache, seq.block_table,
                                                        333, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)


def test_large_scores_do_not_overflow():
    """Scores in the hundreds (attention sinks): the running maximum keeps exp finite."""
    q, k, v, k_cache, v_cache, seq = case(torch.float32, torch.float32, 300, 70)
    q = q * 40
    expected = prefill_attention_torch(q, k, v, k_cache, v_cache, seq, 0.125)
    got = cpu_prefill_attention.paged_prefill_attention(q, k_cache, v_cache, seq.block_table,
                                                        300, 0.125)
    assert torch.isfinite(got).all()
    # One float32 ulp of a score in the hundreds is ~3e-5 of its probability, and the kernel
    # sums the dot products in another order than torch (its plain-C path, on a CPU without
    # AVX-512, measured 1.8e-5 away); an overflow would be off by whole units.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_bad_shapes_are_refused():
    q, _, _, k_cache, v_cache, seq = case(torch.float32, torch.float32, 40, 20)
    with pytest.raises(ValueError):  # more queries than the context holds
        cpu_prefill_attention.paged_prefill_attention(q, k_cache, v_cache, seq.block_table,
                                                      10, 0.125)
    with pytest.raises(ValueError):  # a block table too short for the context
        cpu_prefill_attention.paged_prefill_attention(q, k_cache, v_cache,
                                                      seq.block_table[:1], 40, 0.125)
    with pytest.raises(ValueError):  # bfloat16 queries over a float32 cache: no such kernel
        cpu_prefill_attention.paged_prefill_attention(q.bfloat16(), k_cache, v_cache,
                                                      seq.block_table, 40, 0.125)


def test_the_dispatch_takes_the_measured_path(monkeypatch):
    q, k, v, k_cache, v_cache, seq = case(torch.float32, torch.float32, 100, 30)
    calls = []
    real = cpu_prefill_attention.paged_prefill_attention
    monkeypatch.setattr(cpu_prefill_attention, "paged_prefill_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for faster, use_kernels, expect in [(True, True, 1), (False, True, 0), (True, False, 0)]:
        monkeypatch.setattr(pa, "kernel_is_faster", lambda *a, f=faster: f)
        calls.clear()
        pa.prefill_attention(q, k, v, k_cache, v_cache, seq, 0.125, use_kernels)
        assert len(calls) == expect


def test_the_probe_times_both_and_remembers(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    pa.kernel_is_faster.cache_clear()
    timed = []
    real = pa._time_both
    monkeypatch.setattr(pa, "_time_both", lambda *a: timed.append(a) or real(*a))
    try:
        first = pa.kernel_is_faster(4, 2, 32, torch.float32, torch.float32)
        pa.kernel_is_faster.cache_clear()  # a new process: the stored answer, no second probe
        assert pa.kernel_is_faster(4, 2, 32, torch.float32, torch.float32) == first
        assert len(timed) == 1
        assert list((tmp_path / "tokstream" / "probes").glob("prefill-attention-*.json"))
    finally:
        pa.kernel_is_faster.cache_clear()


@pytest.mark.parametrize("q_dtype,cache_dtype", PAIRS)
def test_the_plain_c_path_equals_the_vector_path(q_dtype, cache_dtype, monkeypatch):
    """The library built without AVX-512 (what a CPU without it runs, and where the probe then
    decides against torch) computes what this machine's build computes."""
    from tokstream.kernels import cpu_build

    plain = cpu_build.Library(cpu_prefill_attention.SOURCE,
                              (*cpu_prefill_attention.FLAGS, "-mno-avx512f"),
                              cpu_prefill_attention._LIBRARY.signatures)
    assert plain.load() is not None and plain.load().prefill_vector_lanes() == 1
    q, _, _, k_cache, v_cache, seq = case(q_dtype, cache_dtype, 333, 150)
    native = cpu_prefill_attention.paged_prefill_attention(q, k_cache, v_cache,
                                                           seq.block_table, 333, 0.125)
    monkeypatch.setattr(cpu_prefill_attention, "_LIBRARY", plain)
    got = cpu_prefill_attention.paged_prefill_attention(q, k_cache, v_cache, seq.block_table,
                                                        333, 0.125)
    torch.testing.assert_close(got.float(), native.float(), rtol=0, atol=TOLERANCE[q_dtype])


@pytest.mark.parametrize("q_dtype,cache_dtype", PAIRS)
def test_a_steps_chunks_in_one_call_equal_each_alone(q_dtype, cache_dtype):
    """Chunks of several sequences (fresh prompts, chunks after a cached prefix, lengths off the
    tiles) in one call, the queries a view into a wider q/k/v row as the model hands them over:
    each chunk's rows are what torch computes for it alone, and rows of no chunk are untouched."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    shapes = [(128, 128), (37, 100), (1, 130), (200, 777), (64, 64)]  # (query_len, context)
    pool = sum(-(-c // block) for _, c in shapes) + 5
    k_cache, v_cache = (torch.randn(kv_heads, pool, block, dim, generator=g).to(cache_dtype)
                        for _ in range(2))
    order = torch.randperm(pool, generator=g)
    lead = 3  # rows before the first chunk (a step's decode rows)
    tokens = lead + sum(q for q, _ in shapes)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(q_dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    seqs, tables, rows, at, start = [], [], [], 0, lead
    for query_len, context in shapes:
        n = -(-context // block)
        table = order[at:at + n]
        at += n
        seqs.append(PrefillSeq(start, query_len, context, table))
        tables.append(table)
        rows.append([start, query_len, context])
        start += query_len
    out = torch.full((tokens, heads, dim), 7.0, dtype=q_dtype)
    cpu_prefill_attention.paged_prefill_attention_batch(
        q, k_cache, v_cache, torch.nn.utils.rnn.pad_sequence(tables, batch_first=True),
        torch.tensor(rows), 0.125, out=out)
    assert (out[:lead] == 7.0).all()
    for seq in seqs:
        chunk = slice(seq.query_start, seq.query_start + seq.query_len)
        positions = torch.arange(seq.context_len - seq.query_len, seq.context_len)
        slots = seq.block_table[positions // block] * block + positions % block
        k, v = (c.view(kv_heads, -1, dim)[:, slots].transpose(0, 1).to(q_dtype)
                for c in (k_cache, v_cache))
        expected = prefill_attention_torch(q[chunk], k, v, k_cache, v_cache, seq, 0.125)
        torch.testing.assert_close(out[chunk].float(), expected.float(), rtol=0,
                                   atol=TOLERANCE[q_dtype])


def test_the_model_makes_one_kernel_call_a_layer_for_all_chunks(monkeypatch):
    """paged_attention hands a step's prefill chunks to the kernel together (a call per chunk
    cost as much as a short prompt's attention)."""
    from tokstream.worker import attention

    q, k, v, k_cache, v_cache, seq = case(torch.float32, torch.float16, 100, 30)
    second = PrefillSeq(30, 30, 100, seq.block_table)
    meta = attention.AttentionMetadata(torch.zeros(60, dtype=torch.int64), 0, None, None,
                                       [PrefillSeq(0, 30, 100, seq.block_table), second])
    calls = []
    real = cpu_prefill_attention.paged_prefill_attention_batch
    monkeypatch.setattr(cpu_prefill_attention, "paged_prefill_attention_batch",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(pa, "kernel_is_faster", lambda *a: True)
    both = torch.cat([q, q])
    out = attention.paged_attention(both, torch.cat([k, k]), torch.cat([v, v]), k_cache,
                                    v_cache, meta, 0.125)
    assert len(calls) == 1
    torch.testing.assert_close(out[:30], out[30:], rtol=0, atol=0)
