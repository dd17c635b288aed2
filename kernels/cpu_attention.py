"""The CPU decode-attention kernel (cpu_paged_attention.c), compiled on first use with the
machine's C compiler and called through ctypes with raw tensor pointers.

Why C and not torch: on CPU, torch has to gather every sequence's blocks into a new tensor
before two batched matmuls, reading and writing the whole context each layer; the kernel
reads each key and value once, straight from the pool. Without a compiler (or with
TOKSTREAM_CPU_KERNELS=0) `load()` returns None and the torch reference runs instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokstream.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = (*cpu_build.BASE_FLAGS, "-std=c11")
_FUNCTIONS = {(torch.float32, torch.float32): "paged_decode_attention_f32",
              (torch.bfloat16, torch.bfloat16): "paged_decode_attention_bf16",
              (torch.float32, torch.float16): "paged_decode_attention_f16kv"}
"""(query dtype, cache dtype) -> kernel; a float16 cache halves the bytes decode reads."""
_SIGNATURE = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
              + [ctypes.c_float, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p])
_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {**{name: _SIGNATURE for name in _FUNCTIONS.values()},
                                             "attention_vector_lanes": ([], ctypes.c_int)})
_scratch: torch.Tensor | None = None


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it once per machine; None if unavailable."""
    return _LIBRARY.load()


def supports(q: torch.Tensor, cache_dtype: torch.dtype | None = None) -> bool:
    return (q.device.type == "cpu" and (q.dtype, cache_dtype or q.dtype) in _FUNCTIONS
            and load() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q (num_seqs, num_heads, head_dim); caches (kv_heads, num_blocks, block_size, head_dim);
    block_tables (num_seqs, max_blocks) int64; context_lens (num_seqs,) int64.
    Returns (num_seqs, num_heads, head_dim) in q's dtype. The cache is in q's dtype, or
    float16 under float32 queries."""
    global _scratch
    library = load()
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    kernel = _FUNCTIONS.get((q.dtype, k_cache.dtype))
    if kernel is None or v_cache.dtype != k_cache.dtype \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"no kernel for {q.dtype} queries over a {k_cache.dtype} cache "
                         "(the cache must be contiguous)")
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    needed = torch.get_num_threads() * group * (max_context + 2 * head_dim)
    if _scratch is None or _scratch.numel() < needed:
        _scratch = torch.empty(needed, dtype=torch.float32)
    out = torch.empty_like(q)
    getattr(library, kernel)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), num_heads, num_kv_heads, head_dim, num_blocks,
        block_size, block_tables.shape[1], scale, 0, num_seqs, _scratch.data_ptr())
    return out
