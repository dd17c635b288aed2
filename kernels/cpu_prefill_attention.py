"""The CPU prefill-attention kernel (cpu_prefill_attention.c): one chunk of a sequence's
prompt attending to its cached prefix and itself, read straight from the paged pool. Compiled
on first use with the machine's C compiler and called through ctypes with raw tensor pointers;
without a compiler (or with TOKSTREAM_CPU_KERNELS=0) `load()` returns None and the torch path
runs instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokstream.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
FLAGS = (*cpu_build.BASE_FLAGS, "-std=c11")
KEY_TILE = 64
"""Keys per packed tile (the C file's KEY_TILE): the packed prefix is padded to a multiple."""
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The C file's dtype codes."""
_PAIRS = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.float16)}
"""(query dtype, cache dtype) the kernel computes: the decode kernel's pairs."""
_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {
    "paged_prefill_attention": [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_void_p] + [ctypes.c_int64] * 7
                               + [ctypes.c_float, ctypes.c_void_p],
    "prefill_thread_floats": ([ctypes.c_int64, ctypes.c_int64], ctypes.c_int64),
    "prefill_vector_lanes": ([], ctypes.c_int)})
_scratch: torch.Tensor | None = None


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it once per machine; None if unavailable."""
    return _LIBRARY.load()


def vector_lanes() -> int:
    """16 where the library was built with its AVX-512 path, 1 for its plain-C one, 0 when
    there is no library."""
    library = load()
    return library.prefill_vector_lanes() if library is not None else 0


def supports(q: torch.Tensor, cache_dtype: torch.dtype) -> bool:
    return (q.device.type == "cpu" and (q.dtype, cache_dtype) in _PAIRS
            and q.shape[-1] % 16 == 0 and load() is not None)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q (query_len, num_heads, head_dim): the chunk's queries, the sequence's last
    query_len positions of context_len; caches (kv_heads, num_blocks, block_size, head_dim)
    holding the chunk's keys and values already; block_table (>= context_len / block_size,)
    int64. Returns (query_len, num_heads, head_dim) in q's dtype, into `out` if given (a
    contiguous tensor of that shape)."""
    global _scratch
    library = load()
    if library is None or not supports(q, k_cache.dtype) or v_cache.dtype != k_cache.dtype \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"no prefill kernel for {q.dtype} queries over a {k_cache.dtype} "
                         "cache (contiguous caches, head_dim a multiple of 16)")
    q = q.contiguous()
    query_len, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    if not 0 < query_len <= context_len or block_table.numel() * block_size < context_len:
        raise ValueError(f"{query_len} queries, {context_len} context, "
                         f"{block_table.numel()} blocks of {block_size}")
    block_table = block_table.to(torch.int64).contiguous()
    tiles = -(-context_len // KEY_TILE)
    needed = (2 * num_kv_heads * tiles * KEY_TILE * head_dim + torch.get_num_threads()
              * library.prefill_thread_floats(num_heads // num_kv_heads, head_dim))
    if _scratch is None or _scratch.numel() < needed:
        _scratch = torch.empty(needed, dtype=torch.float32)
    if out is None:
        out = torch.empty_like(q)
    library.paged_prefill_attention(
        q.data_ptr(), _DTYPES[q.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
        _DTYPES[k_cache.dtype], block_table.data_ptr(), out.data_ptr(), query_len, context_len,
        num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale, _scratch.data_ptr())
    return out
