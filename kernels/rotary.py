"""Rotary position embedding in Triton, applied in place to the queries and keys of a step
(Hugging Face's half-split layout: the pairs are (i, i + head_dim / 2)).

Contract (checked by `apply_rotary`):
- q (num_tokens, num_heads, head_dim), k (num_tokens, num_kv_heads, head_dim), same dtype,
  last dim contiguous; any token and head strides (views into a fused qkv output are fine).
- positions (num_tokens,) int32 / int64.
- cos, sin (max_position, head_dim) float32 tables with cos[:, :half] == cos[:, half:] (the
  layout `tokstream.kernels.torch_ops.Rotary` builds); only the first half of each row is read.
Rotates q and k in place, in float32, rounding once to their dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, stride_tok, stride_head, token, position, cos_ptr, sin_ptr, stride_table,
            num_heads, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_ptr + position * stride_table + i, mask=i < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + position * stride_table + i, mask=i < HALF, other=0.0)[None, :]
    first = x_ptr + token * stride_tok + h[:, None] * stride_head + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, stride_q_tok, stride_q_head,
                   stride_k_tok, stride_k_head, stride_table, num_heads, num_kv_heads,
                   HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate(q_ptr, stride_q_tok, stride_q_head, token, position, cos_ptr, sin_ptr,
                stride_table, num_heads, HEADS_PAD, HALF, HALF_PAD)
    else:
        _rotate(k_ptr, stride_k_tok, stride_k_head, token, position, cos_ptr, sin_ptr,
                stride_table, num_kv_heads, HEADS_PAD, HALF, HALF_PAD)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    """See the module docstring."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype
            or head_dim % 2 or q.stride(2) != 1 or k.stride(2) != 1
            or positions.shape != (num_tokens,) or cos.shape != sin.shape
            or cos.shape[1] != head_dim or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or cos.stride() != sin.stride() or cos.stride(1) != 1):
        raise ValueError("apply_rotary: inputs break the shape/stride contract")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens, 2)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), num_heads, num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(max(num_heads, num_kv_heads)), HALF=half,
        HALF_PAD=triton.next_power_of_2(half))


def reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
    """The same contract in plain torch (float32 math, in place)."""
    half = q.shape[2] // 2
    c = cos[positions.long(), :half][:, None, :]  # (num_tokens, 1, half)
    s = sin[positions.long(), :half][:, None, :]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        x.copy_(rotated.to(x.dtype))
