"""The fused elementwise steps of a decoder layer on CPU (cpu_small_ops.c): residual add +
RMSNorm, rotary embedding in place, SiLU(gate) * up, KV writes, and the row argmax of greedy
sampling. float32 (SiLU(gate) * up bfloat16 too); compiled on first use like
the other CPU kernels. `load()` is None without a compiler, and callers use torch instead."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokstream.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_small_ops.c")
FLAGS = (*cpu_build.BASE_FLAGS, "-std=gnu11")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_LIBRARY = cpu_build.Library(SOURCE, FLAGS, {
    "add_rms_norm": [_P, _P, _P, _F, _I, _I, _P],
    "rotary": [_P, _P, _I, _P, _P, _I, _I, _I, _I],
    "silu_mul": [_P, _I, _I, _P],
    "silu_mul_bf16": [_P, _I, _I, _P],
    "write_kv": [_P, _P, _I, _P, _I, _I, _I, _I, _P, _P],
    "write_kv_f16": [_P, _P, _I, _P, _I, _I, _I, _I, _P, _P],
    "argmax_rows": [_P, _I, _I, _P],
    "small_ops_vector_lanes": ([], ctypes.c_int)})
_WRITE_KV = {torch.float32: "write_kv", torch.float16: "write_kv_f16"}
"""The cache dtypes write_kv can store into (float16: each value rounded once)."""


def load() -> ctypes.CDLL | None:
    return _LIBRARY.load()


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def supports_silu_mul(x: torch.Tensor) -> bool:
    """silu_mul also takes bfloat16 (a prefill's gate/up product on its bfloat16 path)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and load() is not None)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x (T, H) contiguous float32 += delta in place; returns the normalised, scaled x."""
    if delta is not None:
        delta = delta.contiguous()
    out = torch.empty_like(x)
    load().add_rms_norm(x.data_ptr(), delta.data_ptr() if delta is not None else None,
                        weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr())
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q (T, Hq, D), k (T, Hk, D) rotated in place: views into one (T, row) buffer with the
    same row stride and contiguous heads; cos, sin (T, D) contiguous."""
    t, hq, d = q.shape
    load().rotary(q.data_ptr(), k.data_ptr(), q.stride(0), cos.data_ptr(), sin.data_ptr(), t,
                  hq, k.shape[1], d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) contiguous float32 or bfloat16 -> silu(gate) * up (T, I) in its dtype
    (bfloat16: computed in float32 and rounded once, as silu_mul of the widened inputs then a
    cast would give)."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    kernel = load().silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else load().silu_mul
    kernel(gate_up.data_ptr(), t, two_i // 2, out.data_ptr())
    return out


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v (T, kv_heads, D), views into one buffer with one row stride and contiguous heads;
    caches (kv_heads, num_blocks, block_size, D) contiguous, float32 or float16 (_WRITE_KV);
    slot_mapping (T,) int64."""
    t, heads, d = k.shape
    slots = slot_mapping.contiguous()
    write = getattr(load(), _WRITE_KV[k_cache.dtype])
    write(k.data_ptr(), v.data_ptr(), k.stride(0), slots.data_ptr(), t, heads, d,
          k_cache.shape[1] * k_cache.shape[2], k_cache.data_ptr(), v_cache.data_ptr())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x (rows, cols) contiguous float32 -> (rows,) int64, exactly torch.argmax(x, dim=-1)
    (first index on ties, NaN the largest)."""
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    load().argmax_rows(x.data_ptr(), rows, cols, out.data_ptr())
    return out
