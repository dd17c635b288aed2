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
