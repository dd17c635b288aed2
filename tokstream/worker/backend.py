"""Which kernels the model runs. On CPU: plain torch plus the compiled C decode kernel (the
path every CPU test and benchmark measures). On CUDA: the Triton kernels of tokstream.kernels.

TOKSTREAM_KERNELS=torch|triton overrides the choice: torch on a GPU (the reference, to bisect
a kernel bug), triton on CPU tensors under TRITON_INTERPRET=1 (how tests prove the GPU path's
wiring without a GPU).
"""

from __future__ import annotations

import torch

from tokstream import envs
from tokstream.kernels import cpu_small_ops
from tokstream.kernels.torch_ops import apply_rotary, rms_norm, silu_mul
from tokstream.worker import attention


class TorchBackend:
    name = "torch"
    needs_key_bias = True
    """The reference decode attention adds a (num_decodes, max_context) -inf bias."""

    @staticmethod
    def add_rms_norm(x, delta, weight, eps, dtype):
        """x (T, hidden) float32 += delta, then normalised and cast to dtype."""
        if dtype == torch.float32 and x.is_contiguous() and cpu_small_ops.supports(x):
            return cpu_small_ops.add_rms_norm(x, delta, weight, eps)
        if delta is not None:
            x += delta
        return rms_norm(x, weight, eps).to(dtype)

    @staticmethod
    def rope_tables(rotary_module, positions, dtype):
        return rotary_module.tables(positions, dtype)

    @staticmethod
    def rotate(q, k, rope):
        """q (T, heads, D), k (T, kv_heads, D) -> rotated; in place where the C kernel can."""
        cos, sin = rope
        if (cpu_small_ops.supports(q) and cos.dtype == torch.float32 and cos.is_contiguous()
                and sin.is_contiguous()
                # one token: torch reports any row stride for a size-1 dimension
                and (q.shape[0] == 1 or q.stride(0) == k.stride(0))
                and q.stride()[1:] == (q.shape[2], 1) and k.stride()[1:] == (k.shape[2], 1)):
            cpu_small_ops.rotary(q, k, cos, sin)
            return q, k
        return apply_rotary(q, *rope), apply_rotary(k, *rope)

    @staticmethod
    def silu_mul(gate_up):
        """(T, 2 * inter) [gate; up] -> silu(gate) * up (T, inter), in gate_up's dtype (a
        bfloat16 one computed in float32 and rounded once)."""
        if gate_up.is_contiguous() and cpu_small_ops.supports_silu_mul(gate_up):
            return cpu_small_ops.silu_mul(gate_up)
        if gate_up.dtype == torch.bfloat16:
            return silu_mul(gate_up.float()).to(torch.bfloat16)
        return silu_mul(gate_up)

    @staticmethod
    def write_kv(k_cache, v_cache, k, v, slot_mapping):
        if (cpu_small_ops.supports(k) and k_cache.dtype in (torch.float32, torch.float16)
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and (k.shape[0] == 1 or k.stride(0) == v.stride(0))
                and k.stride()[1:] == (k.shape[2], 1) and v.stride()[1:] == (v.shape[2], 1)
                and slot_mapping.dtype == torch.int64):
            cpu_small_ops.write_kv(k_cache, v_cache, k, v, slot_mapping)
        else:
            attention.write_kv(k_cache, v_cache, k, v, slot_mapping)
    attention = staticmethod(attention.paged_attention)


def choose_backend(device: torch.device):
    """TorchBackend or TritonBackend for this device (see the module docstring)."""
    wanted = envs.KERNELS.get()
    if wanted not in ("auto", "torch", "triton"):
        raise ValueError(f"{envs.KERNELS.name} must be auto, torch or triton, not {wanted!r}")
    if wanted == "torch" or (wanted == "auto" and device.type != "cuda"):
        return TorchBackend()
    from tokstream.kernels.triton_backend import TritonBackend
    return TritonBackend()
