"""Paged attention for decode in Triton: one query token per sequence against its block table.

Contract (checked by `paged_decode_attention`):
- q (num_seqs, num_heads, head_dim), float16 / bfloat16 / float32, last dim contiguous.
- k_cache, v_cache (num_kv_heads, num_blocks, block_size, head_dim), q's dtype, head-major
  (the layout of `tokstream.worker.attention`), last dim contiguous; any other strides.
- block_tables (num_seqs, max_blocks) int32 / int64: the cache blocks of each sequence in
  order; entries past a sequence's end are never read.
- context_lens (num_seqs,) int32 / int64: tokens of each sequence in the cache (its new one
  included). 0 is allowed (a padded slot of a CUDA-graph batch) and gives a zero output row.
- num_heads is a multiple of num_kv_heads (GQA: each KV head serves num_heads / num_kv_heads
  query heads).
Returns (num_seqs, num_heads, head_dim) in q's dtype. Scores, softmax and the weighted sum
accumulate in float32.

One program handles one (sequence, KV head, split): it loads the whole group of query heads
that share the KV head, so each key and value is read from memory once per sequence, not once
per query head. With more than one split, each program covers a contiguous share of the
sequence's tiles and a second kernel merges the partial softmaxes (flash-decoding), so a small
batch still fills the GPU. The split share is computed in the kernel from the sequence's own
length, so the launch grid depends only on shapes — what a CUDA graph needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_TILE = 64
"""Key positions per loop iteration (gathered across pages of any block size)."""


@triton.jit
def online_softmax_update(scores, v, m, l, acc, PRECISION: tl.constexpr):
    """One key tile of a flash-attention loop. scores (rows, TILE) float32, masked with -inf;
    v (TILE, DIM_PAD); m, l (rows,) the running max and sum; acc (rows, DIM_PAD) the running
    unnormalised output. Returns the new m, l, acc."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                   part_m_ptr, part_l_ptr, part_acc_ptr, scale,
                   stride_q_seq, stride_q_head, stride_kv_head, stride_kv_block, stride_kv_pos,
                   stride_table, stride_out_seq, stride_out_head,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq).to(tl.int32)
    tiles = (context_len + TILE - 1) // TILE
    tiles_per_split = (tiles + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * tiles_per_split * TILE
    end = tl.minimum(start + tiles_per_split * TILE, context_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    dim_ok = d < HEAD_DIM
    q_mask = (g < GROUP)[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=q_mask, other=0.0)  # (GROUP_PAD, DIM_PAD)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    head_base = kv_head.to(tl.int64) * stride_kv_head
    for tile_start in range(start, end, TILE):
        n = tile_start + tl.arange(0, TILE)
        valid = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = head_base + block * stride_kv_block + (n % BLOCK_SIZE) * stride_kv_pos
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (TILE, DIM_PAD)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (GROUP_PAD, TILE)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        m, l, acc = online_softmax_update(scores, v, m, l, acc, PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials (num_seqs, num_heads, NUM_SPLITS[, DIM_PAD]), float32.
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        head_ok = g < GROUP
        tl.store(part_m_ptr + part, m, mask=head_ok)
        tl.store(part_l_ptr + part, l, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc,
                 mask=head_ok[:, None])


@triton.jit
def _merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_out_seq,
                  stride_out_head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, DIM_PAD)
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + part)  # (NUM_SPLITS,)
    l = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :])  # (NUM_SPLITS, DIM_PAD)
    m_all = tl.max(m, 0)
    # Empty splits have m = -inf; an empty sequence has every m = -inf and gives zeros.
    weight = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def dot_precision(q: torch.Tensor) -> str:
    """float32 inputs keep full float32 products (tf32 would change greedy tokens against the
    CPU path); half-precision inputs are exact in any mode."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def upcast_dot_inputs(q: torch.Tensor) -> bool:
    """Triton's interpreter (CPU tensors) computes tl.dot on bfloat16 as raw bits (numpy has
    no bfloat16), so there the dot inputs are upcast to float32 (exact for bfloat16 values).
    On a GPU the dot takes bfloat16 directly; float16 exercises that path in the interpreter."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_cores: int,
                      tile: int = DEFAULT_TILE) -> int:
    """Splits per sequence so that the grid has ~2 programs per core, each split at least four
    tiles long; a power of two (the merge kernel's width)."""
    wanted = -(-2 * num_cores // max(1, num_seqs * num_kv_heads))
    longest = max(1, max_context // (4 * tile))
    splits = max(1, min(wanted, longest, 64))
    return triton.next_power_of_2(splits)


def device_cores(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on CPU: a small number, so tests exercise splitting


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, max_context: int | None = None,
                           out: torch.Tensor | None = None,
                           tile: int = DEFAULT_TILE) -> torch.Tensor:
    """See the module docstring. num_splits: None chooses from the shapes and max_context
    (default: the block table's capacity); CUDA graphs pass a fixed one. out: a
    (num_seqs, num_heads, head_dim) tensor to fill, last dim contiguous."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    if (k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
            or num_heads % num_kv_heads or k_cache.shape[3] != head_dim
            or q.stride(2) != 1 or k_cache.stride(3) != 1
            or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,)
            or (out is not None and (out.shape != q.shape or out.stride(2) != 1))):
        raise ValueError("paged_decode_attention: inputs break the shape/stride contract")
    group = num_heads // num_kv_heads
    if num_splits is None:
        if max_context is None:
            max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context,
                                       device_cores(q.device), tile)
    dim_pad = triton.next_power_of_2(max(16, head_dim))
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, num_splits, dim_pad, dtype=torch.float32,
                               device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(max(16, group)), HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE=tile, NUM_SPLITS=num_splits,
        PRECISION=dot_precision(q), UPCAST=upcast_dot_inputs(q))
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits)
    return out


def sequence_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                length: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` keys and values of one sequence (its row of the block tables), in
    float32, each KV head repeated for the `group` query heads it serves: what the plain-torch
    references attend to. Two (num_kv_heads * group, length, head_dim) tensors."""
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    blocks = block_table[:-(-length // block_size)].long()
    keys = k_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :length].float()
    values = v_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :length].float()
    return keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, context_lens: torch.Tensor,
              scale: float) -> torch.Tensor:
    """The same contract in plain torch, one sequence at a time, float32 math."""
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[0]
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for i in range(num_seqs):
        n = int(context_lens[i])
        if n == 0:
            continue
        # (num_heads, n, head_dim) each
        keys, values = sequence_kv(k_cache, v_cache, block_tables[i], n, group)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), keys) * scale
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out.to(q.dtype)
