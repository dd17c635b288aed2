"""A Llama-family decoder in torch, over a paged KV cache, shardable for tensor parallelism.

Column-parallel: the fused q/k/v and gate/up projections (each rank holds a slice of the heads
and of the MLP's intermediate features). Row-parallel: o_proj and down_proj (each rank holds the
matching input slice; partial sums are all-reduced). Vocab-parallel: embedding and LM head.
At tp_size 1 every all-reduce is skipped.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokstream.config import ModelConfig
from tokstream.kernels import cpu_bf16_dot
from tokstream.kernels.torch_ops import Rotary
from tokstream.worker.attention import AttentionMetadata
from tokstream.worker.backend import TorchBackend
from tokstream.worker.decode_stack import stack_for_step
from tokstream.worker.onednn_linear import pack, packed_linear, packed_linear_available
from tokstream.worker.quant_linear import (QuantizedWeight, cat_rows, gated_on_bf16dot,
                                           quantized_linear, takes_bfloat16)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           narrow: bool = False) -> torch.Tensor:
    """F.linear for float weights and for GGUF-quantised ones (native weights); narrow: a
    quantised weight's bfloat16 path may hand back its bfloat16 result (quantized_linear)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight, bias, narrow)
    return F.linear(x, weight, bias)


def silu_product(x: torch.Tensor, gate_up: QuantizedWeight) -> torch.Tensor:
    """SiLU(x @ gate^T) * (x @ up^T) in the product itself, for a [gate; up] weight on its
    bf16dot path (gated_on_bf16dot): the bits of the product then silu_mul, without writing the
    (T, 2 * inter) product and reading it back (measured, a 2,048-token prefill's 30 gate/up
    products on a Zen 4: 514 ms against 620)."""
    return cpu_bf16_dot.matmul_silu(x.float(), gate_up.bf16dot)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int, dtype: torch.dtype):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.head_dim = d
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        q, kv = self.num_heads * d, self.num_kv_heads * d
        inter = config.intermediate_size // tp_size

        def param(*shape, dtype=dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        # Norm weights stay float32: the residual stream is float32 whatever the serving dtype.
        self.input_norm = param(h, dtype=torch.float32)
        self.qkv = param(q + 2 * kv, h)  # column-parallel, [q; k; v] of this rank's heads
        self.qkv_bias = param(q + 2 * kv) if config.qkv_bias else None
        self.o_proj = param(h, q)  # row-parallel
        self.post_norm = param(h, dtype=torch.float32)
        self.gate_up = param(2 * inter, h)  # column-parallel, [gate; up]
        self.down = param(h, inter)  # row-parallel
        self.split = (q, kv, kv)
        self.linear = linear
        self.silu_product = silu_product

    def forward(self, x, rope, kv_cache, meta, all_reduce, ops):
        """x (T, hidden) float32, updated in place and returned; ops: the kernel backend."""
        t = x.shape[0]
        h = ops.add_rms_norm(x, None, self.input_norm, self.eps, self.dtype)
        q, k, v = self.linear(h, self.qkv, self.qkv_bias).split(self.split, dim=-1)
        q, k = ops.rotate(q.view(t, self.num_heads, self.head_dim),
                          k.view(t, self.num_kv_heads, self.head_dim), rope)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = ops.attention(q, k, v, k_cache, v_cache, meta, self.head_dim ** -0.5)
        h = ops.add_rms_norm(x, all_reduce(self.linear(attn.reshape(t, -1), self.o_proj)),
                             self.post_norm, self.eps, self.dtype)
        # Where down rounds its input to bfloat16 anyway, gate/up may hand back its bfloat16
        # product (when on its bfloat16 path too) and SiLU·up stays bfloat16: no casts between.
        narrow = takes_bfloat16(self.down, t)
        if gated_on_bf16dot(self.gate_up, t):
            mid = self.silu_product(h, self.gate_up)
        else:
            mid = ops.silu_mul(self.linear(h, self.gate_up, narrow=narrow))
        x += all_reduce(self.linear(mid, self.down))
        return x


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp_rank: int = 0,
                 tp_size: int = 1, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None,
                 backend=None):
        super().__init__()
        self.backend = backend if backend is not None else TorchBackend()
        """The kernels: TorchBackend (CPU) or tokstream.kernels.triton_backend's (CUDA)."""
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.all_reduce = all_reduce or (lambda x: x)
        self.all_gather = all_gather
        self.vocab_per_rank = -(-config.vocab_size // tp_size)
        self.embed = nn.Parameter(
            torch.empty(self.vocab_per_rank, config.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = self.embed if config.tie_word_embeddings else nn.Parameter(
            torch.empty(self.vocab_per_rank, config.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, tp_size, dtype)
                                    for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=torch.float32),
                                 requires_grad=False)
        self.dtype = dtype
        self.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta)
        self.head_linear = linear
        self.fused_decode = True
        """Run decode-only steps' layers as one C call where they can (decode_stack.py);
        False keeps the per-layer path (tests compare the two)."""

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """input_ids, positions (T,) -> hidden states (T, hidden)."""
        # The residual stream is float32 even when weights and cache are bfloat16: matmuls run
        # in the serving dtype, sums and norms keep full precision.
        x = self._embed(input_ids).float()
        rope = self.backend.rope_tables(self.rotary, positions, self.dtype)
        stack = stack_for_step(self, x.shape[0], kv_caches, meta)
        if stack is not None:
            cos, sin = rope
            return stack.run(x, cos[:, 0], sin[:, 0], meta.slot_mapping,
                             meta.decode_block_tables, meta.decode_context_lens)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta, self.all_reduce, self.backend)
        return self.backend.add_rms_norm(x, None, self.norm, self.config.rms_norm_eps, self.dtype)

    def _lookup(self, input_ids):
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.embedding(input_ids)
        return F.embedding(input_ids, self.embed)

    def _embed(self, input_ids):
        if self.tp_size == 1:
            return self._lookup(input_ids)
        first = self.tp_rank * self.vocab_per_rank
        local = input_ids - first
        outside = (local < 0) | (local >= self.vocab_per_rank)
        x = self._lookup(local.masked_fill(outside, 0))
        return self.all_reduce(x.masked_fill(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, hidden) -> logits (S, vocab) in float32, on every rank (the vocab
        shards are gathered)."""
        logits = self.head_linear(hidden, self.lm_head).float()  # (S, vocab_per_rank)
        if self.tp_size > 1:
            logits = torch.cat(self.all_gather(logits), dim=-1)  # (S, vocab_per_rank * tp)
        return logits[:, :self.config.vocab_size]

    def quantized_weights(self) -> list[QuantizedWeight]:
        """The weights kept in their GGUF blocks (native weights), each once."""
        found = [self.embed, self.lm_head]
        for layer in self.layers:
            found += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        unique = {id(w): w for w in found if isinstance(w, QuantizedWeight)}
        return list(unique.values())

    def decoder_weights(self) -> list[QuantizedWeight]:
        """The decoder layers' quantised weights (not the embedding or the LM head)."""
        return [w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up,
                                                     layer.down)
                if isinstance(w, QuantizedWeight)]

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as held: float parameters plus quantised blocks."""
        return (sum(p.numel() * p.element_size() for p in self.parameters())
                + sum(w.nbytes() for w in self.quantized_weights()))

    def pack_weights_for_cpu(self) -> bool:
        """Reorder bfloat16 matmul weights into oneDNN's blocked layout once, instead of on
        every call (measured: decode-size matmuls ~20% faster, batch 1 ~2x). Call after
        load_weights; returns False (and changes nothing) where oneDNN cannot do it."""
        if self.quantized_weights() or not packed_linear_available(self.dtype,
                                                                   self.embed.device):
            return False
        for layer in self.layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                weight = getattr(layer, name).data
                delattr(layer, name)
                setattr(layer, name, pack(weight))
            layer.linear = packed_linear
        head = self.lm_head.data
        del self.lm_head
        self.lm_head = pack(head)
        self.head_linear = packed_linear
        return True

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        """Copy this rank's shard out of a full Hugging Face-named state dict. A matrix given
        as a QuantizedWeight (native GGUF weights) replaces the float parameter and is
        sharded by whole blocks."""
        c, r, n = self.config, self.tp_rank, self.tp_size

        def rows(w):
            # Column-parallel slice: this rank's share of the output features.
            size = w.shape[0] // n
            if isinstance(w, QuantizedWeight):
                return w.rows(r * size, (r + 1) * size)
            return w[r * size:(r + 1) * size]

        def cols(w):
            size = w.shape[1] // n
            if isinstance(w, QuantizedWeight):
                return w.columns(r * size, (r + 1) * size)
            return w[:, r * size:(r + 1) * size]

        def vocab(w):
            begin = r * self.vocab_per_rank
            if isinstance(w, QuantizedWeight):
                shard = w.rows(begin, min(begin + self.vocab_per_rank, w.out_features))
                return shard.padded_rows(self.vocab_per_rank)
            shard = w[begin:begin + self.vocab_per_rank]
            padded = torch.zeros(self.vocab_per_rank, w.shape[1], dtype=w.dtype, device=w.device)
            padded[:shard.shape[0]] = shard
            return padded

        def cat(parts):
            if isinstance(parts[0], QuantizedWeight):
                return cat_rows(parts)
            return torch.cat(parts)

        def put(module, name, value):
            if isinstance(value, QuantizedWeight):
                delattr(module, name)  # the float parameter gives way to the blocks
                setattr(module, name, value)
            else:
                getattr(module, name).copy_(value)

        put(self, "embed", vocab(state_dict["model.embed_tokens.weight"]))
        if c.tie_word_embeddings:
            if isinstance(self.embed, QuantizedWeight):
                put(self, "lm_head", self.embed)
        else:
            put(self, "lm_head", vocab(state_dict["lm_head.weight"]))
        self.norm.copy_(state_dict["model.norm.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            get = lambda name: state_dict[p + name]  # noqa: E731
            layer.input_norm.copy_(get("input_layernorm.weight"))
            layer.post_norm.copy_(get("post_attention_layernorm.weight"))
            put(layer, "qkv", cat([rows(get(f"self_attn.{x}_proj.weight")) for x in "qkv"]))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([rows(get(f"self_attn.{x}_proj.bias"))
                                                for x in "qkv"]))
            put(layer, "o_proj", cols(get("self_attn.o_proj.weight")))
            put(layer, "gate_up", cat([rows(get("mlp.gate_proj.weight")),
                                       rows(get("mlp.up_proj.weight"))]))
            put(layer, "down", cols(get("mlp.down_proj.weight")))
