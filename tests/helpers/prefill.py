"""One fresh causal pass of a model over a whole sequence: a single prefill chunk into a new
paged cache, as the reference the tests hold chunked, batched or quantised passes to."""

from __future__ import annotations

import torch

from tokstream.worker.attention import AttentionMetadata, PrefillSeq
from tokstream.worker.model_runner import allocate_kv_caches


def prefill_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of the model over ids, on the CPU in float32."""
    n = len(ids)
    blocks = -(-n // block_size)
    caches = allocate_kv_caches(model.config, blocks, block_size, 1, torch.float32,
                                torch.device("cpu"))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decodes=0,
                             decode_block_tables=None, decode_key_bias=None,
                             prefills=[PrefillSeq(0, n, n, torch.arange(blocks))])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


def decode_greedy(model, config, prompt, cache_dtype, steps=32, block_size=16):
    """Prefill, then `steps` greedy decode steps through a paged cache of `cache_dtype`:
    (tokens, the logits of every step)."""
    n = len(prompt)
    blocks = torch.arange(-(-(n + steps + 1) // block_size))
    caches = allocate_kv_caches(config, len(blocks), block_size, 1, cache_dtype,
                                torch.device("cpu"))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decodes=0,
                             decode_block_tables=None, decode_key_bias=None,
                             prefills=[PrefillSeq(0, n, n, blocks)])
    tokens, logits = [], []
    with torch.inference_mode():
        out = model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta))
        for step in range(steps + 1):
            logits.append(out[-1:])
            tokens.append(int(out[-1].argmax()))
            position = n + step
            bias = torch.full((1, len(blocks) * block_size), float("-inf"))
            bias[0, :position + 1] = 0
            meta = AttentionMetadata(slot_mapping=torch.tensor([position]), num_decodes=1,
                                     decode_block_tables=blocks[None], decode_key_bias=bias,
                                     prefills=[],
                                     decode_context_lens=torch.tensor([position + 1]))
            out = model.compute_logits(model(torch.tensor(tokens[-1:]),
                                             torch.tensor([position]), caches, meta))
    return tokens, torch.cat(logits)
