"""The CPU prefill-attention kernel (cpu_prefill_attention.c): each prefill chunk of a step
attending to its sequence's cached prefix and itself, read straight from the paged pool, all of
a step's chunks in one call. Compiled
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
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The C file's dtype codes."""
_PAIRS = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.float16)}
"""(query dtype, cache dtype) the kernel computes: the decode kernel's pairs."""
_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {
    "paged_prefill_attention": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                               + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_void_p],
    "prefill_packed_floats": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64],
                              ctypes.c_int64),
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
    """One chunk: q (query_len, num_heads, head_dim), the sequence's last query_len positions
    of context_len; caches (kv_heads, num_blocks, block_size, head_dim) holding the chunk's
    keys and values already; block_table (>= context_len / block_size,) int64. Returns
    (query_len, num_heads, head_dim) in q's dtype, into `out` if given (a contiguous tensor of
    that shape)."""
    seqs = torch.tensor([[0, q.shape[0], context_len]], dtype=torch.int64)
    return paged_prefill_attention_batch(q, k_cache, v_cache, block_table.reshape(1, -1), seqs,
                                         scale, out)


def paged_prefill_attention_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seqs: torch.Tensor, scale: float,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Every prefill chunk of a step at once. q (tokens, num_heads, head_dim), each head's
    values contiguous and the heads one after another (a view into the q/k/v projection's
    output will do); block_tables (num_seqs, >= each one's blocks) int64; seqs (num_seqs, 3)
    int64 rows of (the chunk's first token in q, query_len, context_len). Writes the chunks'
    rows of `out` (tokens, num_heads, head_dim), contiguous in q's dtype (made if not given;
    other rows are left as they are) and returns it."""
    global _scratch
    library = load()
    if library is None or not supports(q, k_cache.dtype) or v_cache.dtype != k_cache.dtype \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"no prefill kernel for {q.dtype} queries over a {k_cache.dtype} "
                         "cache (contiguous caches, head_dim a multiple of 16)")
    tokens, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim or (tokens > 1 and q.stride(0) < num_heads
                                                       * head_dim):
        q = q.contiguous()
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    seqs = seqs.to(torch.int64).contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    starts, query_lens, context_lens = seqs.T.tolist() if seqs.numel() else ([], [], [])
    for start, query_len, context_len in zip(starts, query_lens, context_lens):
        if not 0 < query_len <= context_len or start < 0 or start + query_len > tokens \
                or block_tables.shape[1] * block_size < context_len:
            raise ValueError(f"a chunk of {query_len} queries from token {start} of {tokens}, "
                             f"{context_len} context, {block_tables.shape[1]} blocks of "
                             f"{block_size}")
    if out is None:
        out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype)
    if not seqs.numel():
        return out
    needed = (library.prefill_packed_floats(seqs.data_ptr(), seqs.shape[0], num_kv_heads,
                                            head_dim)
              + torch.get_num_threads()
              * library.prefill_thread_floats(num_heads // num_kv_heads, head_dim))
    if _scratch is None or _scratch.numel() < needed:
        _scratch = torch.empty(needed, dtype=torch.float32)
    library.paged_prefill_attention(
        q.data_ptr(), q.stride(0), _DTYPES[q.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
        _DTYPES[k_cache.dtype], block_tables.data_ptr(), block_tables.shape[1], seqs.data_ptr(),
        seqs.shape[0], out.data_ptr(), num_heads, num_kv_heads, head_dim, num_blocks,
        block_size, scale, _scratch.data_ptr())
    return out
