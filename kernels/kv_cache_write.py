"""KV-cache write in Triton: scatter a step's new keys and values into their cache slots.

Contract (checked by `write_kv`):
- k, v (num_tokens, num_kv_heads, head_dim), the cache's dtype, last dim contiguous (views
  into a fused qkv output are fine).
- k_cache, v_cache (num_kv_heads, num_blocks, block_size, head_dim), head-major, last dim
  contiguous, same strides.
- slot_mapping (num_tokens,) int32 / int64: slot = block * block_size + offset; a negative
  slot skips its token (the padded rows of a CUDA-graph batch).
Writes in place; every other slot is left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_k_tok,
                  stride_k_head, stride_v_tok, stride_v_head, stride_cache_head,
                  stride_cache_block, stride_cache_pos, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    d = tl.arange(0, DIM_PAD)
    mask = d < tl.where(slot >= 0, HEAD_DIM, 0)  # a skipped token moves nothing
    k = tl.load(k_ptr + token * stride_k_tok + head * stride_k_head + d, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + head * stride_v_head + d, mask=mask)
    target = (head * stride_cache_head + (slot // BLOCK_SIZE) * stride_cache_block
              + (slot % BLOCK_SIZE) * stride_cache_pos + d)
    tl.store(k_cache_ptr + target, k, mask=mask)
    tl.store(v_cache_ptr + target, v, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """See the module docstring."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if (k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or k.shape != v.shape or k_cache.shape[0] != num_kv_heads
            or k_cache.shape[3] != head_dim or k.dtype != k_cache.dtype
            or v.dtype != v_cache.dtype or k.stride(2) != 1 or v.stride(2) != 1
            or k_cache.stride(3) != 1 or slot_mapping.shape != (num_tokens,)):
        raise ValueError("write_kv: inputs break the shape/stride contract")
    if num_tokens == 0:
        return
    _write_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[2])


def reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """The same contract in plain torch."""
    num_kv_heads, _, _, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(num_kv_heads, -1, head_dim)[:, slots] = k[keep].transpose(0, 1)
    v_cache.view(num_kv_heads, -1, head_dim)[:, slots] = v[keep].transpose(0, 1)
