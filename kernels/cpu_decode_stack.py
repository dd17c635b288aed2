"""A decode-only step's decoder layers in one C call (cpu_decode_stack.c), for native GGUF
weights on CPU at one rank: the same kernels the per-layer path calls, with no Python between
them. `DecodeStack.run` is the whole stack from the embedded tokens to the final norm.

The layer table (weight and cache pointers) is built once per set of caches; each step passes
only its own small tensors (rotary tables, slots, block tables, context lengths) and reuses
working buffers sized for the largest batch seen so far.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokstream.kernels import (cpu_attention, cpu_bf16_dot, cpu_build, cpu_int16, cpu_quant,
                               cpu_small_ops)

SOURCE = Path(__file__).with_name("cpu_decode_stack.c")
FLAGS = (*cpu_build.BASE_FLAGS, "-std=gnu11")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("quant_matmul", "i16_quantize_rows", "i16_matmul",
                                        "bf16_pack_rows", "bf16_matmul", "bf16_matmul_silu",
                                        "add_rms_norm", "rotary", "silu_mul", "write_kv",
                                        "attention")]


MAX_INT16_RANGES = 8
"""Pairs in a weight's int16 row ranges (cpu_decode_stack.c; quant_linear.MAX_INT16_RANGES)."""


class _QWeight(ctypes.Structure):
    _fields_ = [("data", _P), ("qtype", _I), ("quants", _P), ("scales", _P), ("offsets", _P),
                ("int16_bits", _I), ("int16_ranges", _I * (2 * MAX_INT16_RANGES)),
                ("bf16_pairs", _P), ("bf16_ranges", _I * (2 * MAX_INT16_RANGES))]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _QWeight), ("o_proj", _QWeight),
                ("gate_up", _QWeight), ("down", _QWeight), ("k_cache", _P), ("v_cache", _P)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                        "intermediate", "num_blocks", "block_size")] + [
        ("eps", _F), ("scale", _F)]


_BUFFERS = ("h", "qkv", "q", "attn", "delta", "gate_up", "act")


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _I), ("max_blocks", _I), ("cos", _P), ("sin", _P), ("slots", _P),
                ("block_tables", _P), ("context_lens", _P), ("final_norm", _P)] + [
        (name, _P) for name in _BUFFERS + ("matmul_scratch", "attention_scratch",
                                           "int16_rows", "int16_scales", "int16_sums",
                                           "bf16_rows")]


_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {
    "decode_stack": [_P, _P, _I, _P, _P, _P, _P],
    "stack_products": [_P, _P, _P, _I, _P, _I, _P, _P]})


def _address(library: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


def load() -> ctypes.CDLL | None:
    """The library, with every kernel it calls available; None otherwise."""
    parts = (cpu_quant.load(), cpu_int16.load(), cpu_bf16_dot.load(), cpu_small_ops.load(),
             cpu_attention.load())
    return None if any(p is None for p in parts) else _LIBRARY.load()


_CACHE_KERNELS = {torch.float32: ("write_kv", "paged_decode_attention_f32"),
                  torch.float16: ("write_kv_f16", "paged_decode_attention_f16kv")}
"""The cache dtypes the stack runs over: the KV write and the decode attention for each."""


def _kernels(cache_dtype: torch.dtype) -> _Kernels:
    quant, int16, bf16 = cpu_quant.load(), cpu_int16.load(), cpu_bf16_dot.load()
    small, attention = cpu_small_ops.load(), cpu_attention.load()
    write_kv, decode_attention = _CACHE_KERNELS[cache_dtype]
    return _Kernels(_address(quant, "quant_matmul"), _address(int16, "i16_quantize_rows"),
                    _address(int16, "i16_matmul"), _address(bf16, "bf16_pack_rows"),
                    _address(bf16, "bf16_matmul"), _address(bf16, "bf16_matmul_silu"),
                    _address(small, "add_rms_norm"),
                    _address(small, "rotary"), _address(small, "silu_mul"),
                    _address(small, write_kv), _address(attention, decode_attention))


def supports_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in _CACHE_KERNELS and cache.is_contiguous() and cache.device.type == "cpu"


class DecodeStack:
    """The decoder layers of one model over one set of KV caches, as a single C call.

    `layers`: per layer (input_norm, post_norm, qkv, o_proj, gate_up, down) with the norms
    float32 tensors and the products (data uint8 blocks, ggml type id) pairs; `kv_caches`:
    per layer (k_cache, v_cache) (kv_heads, num_blocks, block_size, head_dim), all float32 or
    all float16 (supports_cache)."""

    def __init__(self, layers, kv_caches, final_norm: torch.Tensor, hidden: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 eps: float):
        self._library = load()
        num_kv, num_blocks, block_size, _ = kv_caches[0][0].shape
        self._dims = _Dims(hidden, num_heads, num_kv_heads, head_dim, intermediate, num_blocks,
                           block_size, eps, head_dim ** -0.5)
        self._kernels = _kernels(kv_caches[0][0].dtype)
        table = (_Layer * len(layers))()
        for entry, (norms_and_weights, (k_cache, v_cache)) in zip(table, zip(layers, kv_caches)):
            input_norm, post_norm, *products = norms_and_weights
            entry.input_norm, entry.post_norm = input_norm.data_ptr(), post_norm.data_ptr()
            for field, w in zip(("qkv", "o_proj", "gate_up", "down"), products):
                setattr(entry, field, _qweight(w))
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._table = table
        # The tensors the table points into stay alive as long as it does.
        self._keep = (layers, kv_caches, final_norm)
        self._final_norm = final_norm
        self._widths = {"h": hidden, "qkv": (num_heads + 2 * num_kv_heads) * head_dim,
                        "q": num_heads * head_dim, "attn": num_heads * head_dim,
                        "delta": hidden, "gate_up": 2 * intermediate, "act": intermediate}
        self._matmul_scratch = torch.empty(
            cpu_quant.scratch_floats(max(hidden, intermediate, num_heads * head_dim)))
        self._group = num_heads // num_kv_heads
        self._widest_input = max(hidden, intermediate, num_heads * head_dim)
        self._buffers: dict[str, torch.Tensor] = {}
        self._attention_scratch = torch.empty(0)

    def _buffer(self, name: str, tokens: int) -> torch.Tensor:
        return self._sized(name, (tokens, self._widths[name]))

    def _sized(self, name: str, shape: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
        """A working buffer of at least shape[0] rows, grown (never shrunk) as batches do."""
        found = self._buffers.get(name)
        if found is None or found.shape[0] < shape[0]:
            found = self._buffers[name] = torch.empty(shape, dtype=dtype)
        return found

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            slots: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) float32 embedded tokens, updated in place; cos, sin (T, head_dim);
        slots, context_lens (T,) int64; block_tables (T, max_blocks) int64. Returns the final
        norm's output (T, hidden)."""
        tokens = x.shape[0]
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, block_tables = slots.contiguous(), block_tables.contiguous()
        context_lens = context_lens.contiguous()
        max_blocks = block_tables.shape[1]
        needed = torch.get_num_threads() * self._group * (
            max_blocks * self._dims.block_size + 2 * self._dims.head_dim)
        if self._attention_scratch.numel() < needed:
            self._attention_scratch = torch.empty(needed)
        out = torch.empty_like(x)
        int16_rows = self._sized("int16_rows", (tokens, self._widest_input), torch.int16)
        int16_scales = self._sized("int16_scales", (tokens, self._widest_input // 32))
        int16_sums = self._sized("int16_sums", (tokens, self._widest_input // 32))
        bf16_rows = self._sized("bf16_rows", (tokens, self._widest_input // 2), torch.int32)
        step = _Step(tokens, max_blocks, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                     block_tables.data_ptr(), context_lens.data_ptr(),
                     self._final_norm.data_ptr(),
                     *(self._buffer(name, tokens).data_ptr() for name in _BUFFERS),
                     self._matmul_scratch.data_ptr(), self._attention_scratch.data_ptr(),
                     int16_rows.data_ptr(), int16_scales.data_ptr(), int16_sums.data_ptr(),
                     bf16_rows.data_ptr())
        self._library.decode_stack(ctypes.byref(self._kernels), self._table, len(self._table),
                                   ctypes.byref(self._dims), ctypes.byref(step), x.data_ptr(),
                                   out.data_ptr())
        return out


def _qweight(w, int16_rows=None, bf16dot_rows=None) -> _QWeight:
    """A QuantizedWeight as the C table's entry (its int16 and bf16dot copies only where it
    has them), at its own row ranges unless others are given."""
    int16_rows = w.int16_rows if int16_rows is None else int16_rows
    bf16dot_rows = w.bf16dot_rows if bf16dot_rows is None else bf16dot_rows
    entry = _QWeight(w.data.data_ptr(), w.qtype, None, None, None, 8,
                     _ranges(int16_rows if w.int16 is not None else ()), None,
                     _ranges(bf16dot_rows if w.bf16dot is not None else ()))
    if w.int16 is not None:
        entry.quants, entry.scales = w.int16.quants.data_ptr(), w.int16.scales.data_ptr()
        entry.offsets = w.int16.offsets.data_ptr() if w.int16.offsets is not None else None
        entry.int16_bits = w.int16.bits
    if w.bf16dot is not None:
        entry.bf16_pairs = w.bf16dot.pairs.data_ptr()
    return entry


def _ranges(rows: tuple[tuple[int, int], ...]):
    """Row ranges as the C table's (lo, hi) pairs, (0, 0) for the unused ones."""
    if len(rows) > MAX_INT16_RANGES:
        raise ValueError(f"{len(rows)} row ranges; the table holds {MAX_INT16_RANGES}")
    return (_I * (2 * MAX_INT16_RANGES))(*(bound for pair in rows for bound in pair))


def products(weights, rows: int, path: str):
    """A call that takes every weight's product of `rows` random input rows in turn by `path`
    (fused, int16 or bf16dot: the weights must hold its copy), through the stack's own C
    dispatch with no Python between the products: what a decode step's products cost, for the
    crossover probe. None where the library is unavailable."""
    library = load()
    if library is None:
        return None
    n = len(weights)
    table = (_QWeight * n)()
    everything = ((1, 1 << 62),)
    for i, w in enumerate(weights):
        table[i] = _qweight(w, everything if path == "int16" else (),
                            everything if path == "bf16dot" else ())
    shapes = torch.tensor([d for w in weights for d in (w.out_features, w.in_features)],
                          dtype=torch.int64)
    widest_in = max(w.in_features for w in weights)
    x = torch.randn(rows, widest_in)
    out = torch.empty(rows, max(w.out_features for w in weights))
    buffers = {"matmul_scratch": torch.empty(cpu_quant.scratch_floats(widest_in)),
               "int16_rows": torch.empty(rows, widest_in, dtype=torch.int16),
               "int16_scales": torch.empty(rows, widest_in // 32),
               "int16_sums": torch.empty(rows, widest_in // 32),
               "bf16_rows": torch.empty(rows, widest_in // 2, dtype=torch.int32)}
    step = _Step(rows, 0, *([None] * 6), *([None] * len(_BUFFERS)),
                 *(buffers[name].data_ptr() for name in ("matmul_scratch",)), None,
                 *(buffers[name].data_ptr() for name in ("int16_rows", "int16_scales",
                                                         "int16_sums", "bf16_rows")))
    kernels = _kernels(torch.float32)

    def run(keep=(weights, buffers)):  # the tensors the table and step point into
        """The last weight's product of x (x, out: what it read and wrote)."""
        library.stack_products(ctypes.byref(kernels), table, shapes.data_ptr(), n,
                               x.data_ptr(), rows, out.data_ptr(), ctypes.byref(step))
        last = weights[-1]  # the buffers hold (rows, its inputs) and (rows, its outputs)
        return (x.view(-1)[:rows * last.in_features].view(rows, last.in_features),
                out.view(-1)[:rows * last.out_features].view(rows, last.out_features))
    return run
