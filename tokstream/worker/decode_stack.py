"""When a step may run its decoder layers as one C call (kernels/cpu_decode_stack.c), and the
call's table of weights and caches, built once per set of caches.

It may when the step is decode-only (decode rows: a speculative verify chunk's positions
are rows of it too, model_runner.prepare), on CPU at one rank with the torch backend, in float32
over a float32 or float16 cache, with every layer's products in native GGUF blocks below
their measured crossover (where the per-layer path would switch to a float or bfloat16 matrix
product;
the int16 products below it run in the stack too),
and the compiled kernels are there.
Anything else runs the per-layer path, which computes the same thing.
"""

from __future__ import annotations

import torch

from tokstream.kernels import cpu_decode_stack
from tokstream.worker.attention import AttentionMetadata
from tokstream.worker.quant_linear import QuantizedWeight


def stack_for_step(model, num_tokens: int, kv_caches, meta: AttentionMetadata):
    """The model's DecodeStack for these caches if this step can use it, else None."""
    if not (model.fused_decode and meta.use_kernels and not meta.prefills
            and meta.num_decodes == num_tokens and meta.decode_context_lens is not None
            and meta.decode_block_tables is not None and model.tp_size == 1
            and model.backend.name == "torch" and model.dtype == torch.float32
            and model.norm.device.type == "cpu"):
        return None
    limit = _row_limit(model)
    if limit is None or num_tokens >= limit:
        return None
    key = tuple((k.data_ptr(), v.data_ptr(), k.shape) for k, v in kv_caches)
    cached = getattr(model, "_decode_stack", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    dtypes = {cache.dtype for pair in kv_caches for cache in pair}
    if len(dtypes) != 1 or not all(cpu_decode_stack.supports_cache(cache)
                                   for pair in kv_caches for cache in pair) \
            or cpu_decode_stack.load() is None:
        return None
    c, layers = model.config, []
    for layer in model.layers:
        layers.append((layer.input_norm, layer.post_norm, layer.qkv, layer.o_proj,
                       layer.gate_up, layer.down))
    stack = cpu_decode_stack.DecodeStack(
        layers, kv_caches, model.norm, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
        c.intermediate_size, c.rms_norm_eps)
    model._decode_stack = (key, stack)
    return stack


def _row_limit(model) -> int | None:
    """The fewest rows at which some layer product would leave the fused kernel; None if a
    layer is not all native blocks (or has a bias the C loop does not add)."""
    limit = None
    for layer in model.layers:
        if layer.qkv_bias is not None:
            return None
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            if not isinstance(w, QuantizedWeight):
                return None
            limit = w.float_from if limit is None else min(limit, w.float_from)
    return limit

