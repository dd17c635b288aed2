"""Attention for one prefill chunk: the chunk's queries against the sequence's cached prefix and
the chunk itself (causal), on whichever of two paths measures faster on this machine.

The C kernel (kernels/cpu_prefill_attention.c) reads the prefix straight from the paged pool;
torch's scaled_dot_product_attention needs it gathered out first and an explicit mask. On a
2-core Zen 5 the kernel took 28 ms a layer where torch took 65 (a 512-token chunk at 8k
context), but where torch's bfloat16 products run on matrix units (AMX) the answer may differ,
so it is timed once per machine and shape (probe_cache) instead of assumed.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokstream.kernels import cpu_prefill_attention
from tokstream.worker import probe_cache

log = logging.getLogger("tokstream.worker")

PROBE_QUERIES, PROBE_CONTEXT = 256, 2048
"""The probe's chunk: mid-sized, at a context where the prefix dominates, as in long prompts."""


@dataclass
class PrefillSeq:
    query_start: int
    """Index of the chunk's first token in the step's flattened tokens."""
    query_len: int
    context_len: int
    """Tokens of this sequence in the cache after this step (cached prefix + this chunk)."""
    block_table: torch.Tensor
    """(num_blocks_of_seq,) int64."""


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """(num_seqs, max_blocks) block ids -> (kv_heads, num_seqs, max_blocks*block_size, dim),
    in `dtype` (the queries' dtype, where the cache is kept narrower)."""
    num_seqs, max_blocks = block_tables.shape
    num_kv_heads, _, block_size, head_dim = cache.shape
    gathered = cache.index_select(1, block_tables.flatten()).to(dtype)
    return gathered.view(num_kv_heads, num_seqs, max_blocks * block_size, head_dim)


def prefill_attention(q, k, v, k_cache, v_cache, seq: PrefillSeq, scale: float,
                      use_kernels: bool = True) -> torch.Tensor:
    """q (query_len, num_heads, head_dim); k, v (query_len, num_kv_heads, head_dim), already
    written to the cache. Returns (query_len, num_heads, head_dim)."""
    if use_kernels and kernel_takes(q, k_cache):
        return cpu_prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, seq.block_table, seq.context_len, scale)
    return prefill_attention_torch(q, k, v, k_cache, v_cache, seq, scale)


def kernel_takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether prefill chunks of these queries over this cache go to the C kernel: it computes
    them, and measured faster than torch on this machine."""
    return cpu_prefill_attention.supports(q, k_cache.dtype) and kernel_is_faster(
        q.shape[1], k_cache.shape[0], q.shape[2], q.dtype, k_cache.dtype)


def prefill_attention_torch(q, k, v, k_cache, v_cache, seq: PrefillSeq, scale: float):
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv_heads
    # Inputs get a batch dimension: on CPU, 3-D inputs take a slow fallback path (measured:
    # 128-token causal chunk 30 ms -> 3 ms, 1024 x 1024 191 ms -> 52 ms per layer, bfloat16).
    if k_cache.dtype != k.dtype:
        # A narrower cache (float16 under float32): attend to the values it holds, as every
        # later decode step will, so a request re-prefilled after a preemption or a restart
        # computes exactly what it computed the first time.
        k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
    if seq.context_len == seq.query_len:
        # Nothing cached before this chunk: attend to the chunk itself, plain causal.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    keys = gather_blocks(k_cache, seq.block_table[None], q.dtype)[:, 0, :seq.context_len]
    values = gather_blocks(v_cache, seq.block_table[None], q.dtype)[:, 0, :seq.context_len]
    # Query i sits at position context_len - query_len + i and sees keys up to it.
    query_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=q.device)
    mask = torch.arange(seq.context_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scale,
        enable_gqa=gqa)
    return out[0].transpose(0, 1)


@functools.cache
def kernel_is_faster(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     cache_dtype: torch.dtype) -> bool:
    """Whether the C kernel beat torch on a probe chunk of this shape (timed once per machine,
    then read from the probe cache; once per process at most)."""
    file = probe_cache.path("prefill-attention", str(num_heads), str(num_kv_heads),
                            str(head_dim), str(dtype), str(cache_dtype),
                            cpu_prefill_attention.SOURCE.read_text())
    cached = probe_cache.load(file)
    if cached is not None and isinstance(cached.get("kernel"), bool):
        return cached["kernel"]
    load_average = os.getloadavg()[0]
    times = _time_both(num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    kernel = times["kernel"] < times["torch"]
    log.info("prefill attention: C kernel %.1f ms, torch %.1f ms a layer (%d queries at %d "
             "context): %s", 1e3 * times["kernel"], 1e3 * times["torch"], PROBE_QUERIES,
             PROBE_CONTEXT, "kernel" if kernel else "torch")
    probe_cache.store(file, {"kernel": kernel, "seconds": times}, load_average)
    return kernel


def _time_both(num_heads, num_kv_heads, head_dim, dtype, cache_dtype) -> dict[str, float]:
    block_size = 16
    blocks = PROBE_CONTEXT // block_size
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(num_kv_heads, blocks, block_size, head_dim,
                                    generator=generator).to(cache_dtype) for _ in range(2))
    q = torch.randn(PROBE_QUERIES, num_heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(PROBE_QUERIES, num_kv_heads, head_dim, generator=generator).to(dtype)
            for _ in range(2))
    seq = PrefillSeq(0, PROBE_QUERIES, PROBE_CONTEXT, torch.arange(blocks))
    scale = head_dim ** -0.5
    return probe_cache.best_times({
        "kernel": lambda: cpu_prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, seq.block_table, PROBE_CONTEXT, scale),
        "torch": lambda: prefill_attention_torch(q, k, v, k_cache, v_cache, seq, scale)},
        repeats=3)
