"""Paged attention for prefill chunks in Triton: causal, variable length, each chunk attending
to its sequence's cached prefix blocks plus the chunk itself.

Contract (checked by `paged_prefill_attention`):
- q (num_tokens, num_heads, head_dim): the chunks of all sequences, concatenated; float16 /
  bfloat16 / float32, last dim contiguous.
- k_cache, v_cache (num_kv_heads, num_blocks, block_size, head_dim) in q's dtype, head-major,
  last dim contiguous, already holding every chunk's own keys and values (write first).
- query_starts, query_lens, context_lens (num_seqs,) int32 / int64: sequence i's chunk is
  q[query_starts[i] : query_starts[i] + query_lens[i]] and, after this step, the cache holds
  context_lens[i] tokens of it, so its query j sits at position
  context_lens[i] - query_lens[i] + j and sees the keys at positions 0..that position.
- block_tables (num_seqs, max_blocks) int32 / int64, covering context_lens[i] tokens.
- num_heads is a multiple of num_kv_heads (GQA).
Returns out (num_tokens, num_heads, head_dim) in q's dtype; rows of q not covered by any
chunk are left as they were in `out` (callers pass a fresh tensor or one to fill).
Scores, softmax and sums in float32.

One program per (sequence, query head, tile of BLOCK_M queries): an online softmax over key
tiles of BLOCK_N positions, up to the last query's position (causal). The grid's third
dimension covers the longest chunk; programs past a shorter chunk's end do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokstream.kernels.paged_decode_attention import (dot_precision, online_softmax_update,
                                                      sequence_kv, upcast_dot_inputs)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, qlens_ptr, lens_ptr, tables_ptr,
                    scale, stride_q_tok, stride_q_head, stride_kv_head, stride_kv_block,
                    stride_kv_pos, stride_table, stride_out_tok, stride_out_head,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(starts_ptr + seq).to(tl.int64)
    query_len = tl.load(qlens_ptr + seq).to(tl.int32)
    context_len = tl.load(lens_ptr + seq).to(tl.int32)
    prefix = context_len - query_len

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < query_len
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < HEAD_DIM
    q_rows = (query_start + i) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0)  # (BLOCK_M, DIM_PAD)
    if UPCAST:
        q = q.to(tl.float32)
    position = prefix + i  # each query's position in its sequence

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DIM_PAD), tl.float32)
    # Keys up to the tile's last real query; nothing at all for a tile past the chunk.
    end = tl.where(tile * BLOCK_M < query_len,
                   tl.minimum(context_len, prefix + (tile + 1) * BLOCK_M), 0)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    head_base = (head // GROUP).to(tl.int64) * stride_kv_head
    for key_start in range(0, end, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)
        key_ok = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        rows = head_base + block * stride_kv_block + (n % BLOCK_SIZE) * stride_kv_pos
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        visible = key_ok[None, :] & (n[None, :] <= position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees key 0 in the first tile, so m is finite from then on.
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        m, l, acc = online_softmax_update(scores, v, m, l, acc, PRECISION)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    out_rows = (query_start + i) * stride_out_tok + head * stride_out_head
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_starts: torch.Tensor, query_lens: torch.Tensor,
                            context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, max_query_len: int, out: torch.Tensor | None = None,
                            block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """See the module docstring. max_query_len: the longest chunk (sizes the grid without a
    device-to-host read)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs = query_lens.shape[0]
    if (k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
            or num_heads % num_kv_heads or k_cache.shape[3] != head_dim
            or q.stride(2) != 1 or k_cache.stride(3) != 1
            or query_starts.shape != (num_seqs,) or context_lens.shape != (num_seqs,)
            or block_tables.shape[0] != num_seqs):
        raise ValueError("paged_prefill_attention: inputs break the shape/stride contract")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_starts, query_lens, context_lens, block_tables, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(max(16, head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q),
        UPCAST=upcast_dot_inputs(q))
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
              block_tables: torch.Tensor, scale: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The same contract in plain torch, one sequence at a time, float32 math."""
    group = q.shape[1] // k_cache.shape[0]
    out = torch.empty_like(q) if out is None else out
    for i in range(query_lens.shape[0]):
        start, n, length = int(query_starts[i]), int(query_lens[i]), int(context_lens[i])
        if n == 0:
            continue
        # (num_heads, length, head_dim) each
        keys, values = sequence_kv(k_cache, v_cache, block_tables[i], length, group)
        queries = q[start:start + n].float().transpose(0, 1)  # (num_heads, n, head_dim)
        scores = queries @ keys.transpose(1, 2) * scale  # (num_heads, n, length)
        position = torch.arange(length - n, length, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= position[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + n] = (scores.softmax(-1) @ values).transpose(0, 1).to(q.dtype)
    return out
