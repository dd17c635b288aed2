"""Which kernels the model runs. On CPU: plain torch plus the compiled C decode kernel (the
path every CPU test and benchmark measures). On CUDA: the Triton kernels of tokstream.kernels.

TOKSTREAM_KERNELS=torch|triton overrides the choice: torch on a GPU (the reference, to bisect
a kernel bug), triton on CPU tensors under TRITON_INTERPRET=1 (how tests prove the GPU path's
wiring without a GPU).
"""

from __future__ import annotations

import os

import torch

from tokstream.worker import attention
from tokstream.worker.model import apply_rotary, rms_norm

BACKEND_ENV = "TOKSTREAM_KERNELS"


class TorchBackend:
    name = "torch"
    needs_key_bias = True
    """The reference decode attention adds a (num_decodes, max_context) -inf bias."""

    @staticmethod
    def add_rms_norm(x, delta, weight, eps, dtype):
        """x (T, hidden) float32 += delta, then normalised and cast to dtype."""
        if delta is not None:
            x += delta
        return rms_norm(x, weight, eps).to(dtype)

    @staticmethod
    def rope_tables(rotary_module, positions, dtype):
        return rotary_module.tables(positions, dtype)

    @staticmethod
    def rotate(q, k, rope):
        return apply_rotary(q, *rope), apply_rotary(k, *rope)

    write_kv = staticmethod(attention.write_kv)
    attention = staticmethod(attention.paged_attention)


def choose_backend(device: torch.device):
    """TorchBackend or TritonBackend for this device (see the module docstring)."""
    wanted = os.environ.get(BACKEND_ENV, "auto")
    if wanted not in ("auto", "torch", "triton"):
        raise ValueError(f"{BACKEND_ENV} must be auto, torch or triton, not {wanted!r}")
    if wanted == "torch" or (wanted == "auto" and device.type != "cuda"):
        return TorchBackend()
    from tokstream.kernels.triton_backend import TritonBackend
    return TritonBackend()
