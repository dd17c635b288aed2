"""The Triton kernels behind the model's kernel interface (see tokstream.worker.backend):
what `--device cuda` runs, and what tests run on CPU tensors under Triton's interpreter."""

from __future__ import annotations

import torch

from tokstream.kernels import (kv_cache_write, paged_decode_attention, paged_prefill_attention,
                               rms_norm, rotary)


class TritonBackend:
    name = "triton"
    needs_key_bias = False
    """The decode kernel masks by context length; the reference's bias tensor is not built."""

    @staticmethod
    def add_rms_norm(x, delta, weight, eps, dtype):
        return rms_norm.add_rms_norm(x, delta, weight, eps, dtype)

    @staticmethod
    def rope_tables(rotary_module, positions, dtype):
        # The kernel reads the float32 tables by position itself: nothing is gathered per step.
        return positions, rotary_module.cos, rotary_module.sin

    @staticmethod
    def rotate(q, k, rope):
        rotary.apply_rotary(q, k, *rope)
        return q, k

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def write_kv(k_cache, v_cache, k, v, slot_mapping):
        kv_cache_write.write_kv(k_cache, v_cache, k, v, slot_mapping)

    @staticmethod
    def attention(q, k, v, k_cache, v_cache, meta, scale):
        """q (num_tokens, num_heads, head_dim): decodes first, then prefill chunks."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = meta.num_decodes
        if n:
            paged_decode_attention.paged_decode_attention(
                q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                scale, num_splits=meta.decode_num_splits, out=out[:n])
        if meta.prefills:
            batch = meta.prefill_batch()
            paged_prefill_attention.paged_prefill_attention(
                q, k_cache, v_cache, batch.query_starts, batch.query_lens, batch.context_lens,
                batch.block_tables, scale, batch.max_query_len, out=out)
        return out
