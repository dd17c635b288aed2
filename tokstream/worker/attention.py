"""Paged attention in plain torch: the reference that always runs (CPU, and GPU without Triton).

The cache for one layer is a pair of tensors (num_kv_heads, num_blocks, block_size, head_dim):
head-major, so gathering a sequence's blocks gives each head's keys contiguous and attention
is two batched matmuls with no further copy (measured on CPU: 7x faster than gathering
token-major blocks into scaled_dot_product_attention in bfloat16, 1.2x in float32).
A step's tokens are laid out decode rows first (one query each, with its own block table and
context length: a speculative verify chunk is one row per position, its sequence repeating),
then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokstream.kernels import cpu_attention, cpu_prefill_attention
from tokstream.worker.prefill_attention import (PrefillSeq, gather_blocks, kernel_takes,
                                                prefill_attention)


@dataclass
class PrefillBatch:
    """A step's prefill chunks as device tensors, for kernels that take them all at once."""

    query_starts: torch.Tensor
    """(num_prefills,) int32, like the other per-sequence rows."""
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    """(num_prefills, max_blocks) int64, padded with block 0."""
    max_query_len: int
    host_rows: torch.Tensor
    """(num_prefills, 3) int64 on the host: (query_start, query_len, context_len) per chunk,
    as the CPU kernel takes them."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: the cache slot each new token's K/V is written to."""
    num_decodes: int
    """Decode rows at the head of the step's tokens; rows of one sequence may repeat (each
    attends to the cache up to its own context length)."""
    decode_block_tables: torch.Tensor | None
    """(num_decodes, max_blocks) int64, padded with block 0."""
    decode_key_bias: torch.Tensor | None
    """(num_decodes, max_blocks * block_size) float32: 0 where a key position is real, -inf
    past the sequence's end."""
    prefills: list[PrefillSeq]
    decode_context_lens: torch.Tensor | None = None
    """(num_decodes,) int64: tokens in the cache for each decode, its new one included."""
    use_kernels: bool = True
    """Use the compiled kernel where one fits (tests turn it off to compare)."""
    decode_num_splits: int | None = None
    """Splits per sequence for the Triton decode kernel; None lets it choose from the shapes
    (a CUDA graph fixes one per batch size)."""
    _prefill_batch: PrefillBatch | None = field(default=None, repr=False)

    def prefill_batch(self) -> PrefillBatch:
        """The prefills as tensors, built once per step (every layer shares them)."""
        if self._prefill_batch is None:
            seqs = self.prefills
            device = seqs[0].block_table.device
            rows = torch.tensor([[s.query_start for s in seqs], [s.query_len for s in seqs],
                                 [s.context_len for s in seqs]], dtype=torch.int64)
            starts, query_lens, context_lens = rows.to(device, torch.int32)  # (3, num_prefills)
            tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in seqs],
                                                     batch_first=True)
            self._prefill_batch = PrefillBatch(starts, query_lens, context_lens, tables,
                                               max(s.query_len for s in seqs),
                                               rows.T.contiguous())
        return self._prefill_batch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys and values (num_tokens, num_kv_heads, head_dim) into their slots."""
    num_kv_heads, _, _, head_dim = k_cache.shape
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # a float16 cache under float32 compute
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (num_tokens, num_heads, head_dim); k, v (num_tokens, num_kv_heads, head_dim), already
    written to the cache. Returns (num_tokens, num_heads, head_dim)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decodes
    if n:
        out[:n] = _decode_attention(q[:n], k_cache, v_cache, meta, scale)
    if meta.prefills and meta.use_kernels and kernel_takes(q, k_cache):
        batch = meta.prefill_batch()
        cpu_prefill_attention.paged_prefill_attention_batch(
            q, k_cache, v_cache, batch.block_tables, batch.host_rows, scale, out=out)
        return out
    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale,
                                      meta.use_kernels)
    return out


def _decode_attention(q, k_cache, v_cache, meta, scale):
    if meta.use_kernels and meta.decode_context_lens is not None \
            and cpu_attention.supports(q, k_cache.dtype):
        return cpu_attention.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    return _decode_attention_reference(q, k_cache, v_cache, meta, scale)


def _decode_attention_reference(q, k_cache, v_cache, meta, scale):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    keys = gather_blocks(k_cache, meta.decode_block_tables, q.dtype)  # (kv_heads, S, L, head_dim)
    values = gather_blocks(v_cache, meta.decode_block_tables, q.dtype)
    q = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)  # (kv_heads, S, G, D)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (kv_heads, S, G, L)
    scores += meta.decode_key_bias[None, :, None, :]
    probs = scores.softmax(-1).to(values.dtype)
    out = torch.matmul(probs, values)  # (kv_heads, S, G, head_dim)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)
