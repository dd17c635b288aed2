"""Fused residual add + RMSNorm in Triton.

Contract (checked by `add_rms_norm`):
- x (num_tokens, hidden) float32, contiguous rows: the residual stream, updated in place
  (x += delta) when delta is given.
- delta (num_tokens, hidden) any float dtype, last dim contiguous, or None.
- weight (hidden,) float32.
Returns (num_tokens, hidden) in out_dtype: rms_norm(x) * weight, computed in float32 on the
updated x. One program per token row: the add, the sum of squares and the scaling read the row
once and write it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, stride_x, stride_delta,
                         stride_out, eps, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, HIDDEN_PAD)
    mask = c < HIDDEN
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * stride_delta + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * stride_x + c, x, mask=mask)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + c, mask=mask, other=0.0)
    normed = x * inverse_rms * weight
    tl.store(out_ptr + row * stride_out + c, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring; out: a (num_tokens, hidden) out_dtype tensor to fill."""
    num_tokens, hidden = x.shape
    if (x.dtype != torch.float32 or x.stride(1) != 1 or weight.shape != (hidden,)
            or weight.dtype != torch.float32
            or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1))
            or (out is not None and (out.shape != x.shape or out.dtype != out_dtype
                                     or out.stride(1) != 1))):
        raise ValueError("add_rms_norm: inputs break the shape/stride contract")
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=x.device)
    if num_tokens == 0:
        return out
    _add_rms_norm_kernel[(num_tokens,)](
        x, x if delta is None else delta, weight, out, x.stride(0),
        0 if delta is None else delta.stride(0), out.stride(0), eps, HIDDEN=hidden,
        HIDDEN_PAD=triton.next_power_of_2(hidden), HAS_DELTA=delta is not None)
    return out


def reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    """The same contract in plain torch."""
    if delta is not None:
        x += delta.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight).to(out_dtype)
