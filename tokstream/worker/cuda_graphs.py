"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step of a large model on a GPU is a few hundred small kernel launches; launched one by
one from Python they take longer than the GPU needs to run them (at batch 1 the step would be
bound by the CPU, not by reading the weights). A graph replays the whole step with one launch.

A graph replays fixed addresses and fixed shapes, so every input lives in a static buffer sized
for the largest batch, a step of n sequences runs the graph of the smallest captured size
>= n, and the padded rows are made harmless: slot -1 (their keys and values are written
nowhere) and context length 0 (they attend to nothing and give zeros, which are never sampled).
The decode kernel's split count is fixed per graph; each sequence's share of the splits is
computed on the GPU from its own length.

Correctness never depends on graphs: steps with prefill chunks, batches larger than the
largest graph and TOKSTREAM_CUDA_GRAPHS=0 run eagerly, on the same kernels.
"""

from __future__ import annotations

import bisect

import torch

from tokstream import envs
from tokstream.worker.attention import AttentionMetadata

MAX_GRAPH_BATCH = 256
"""Largest batch captured: bigger decode batches are compute-bound and gain little."""


def graphs_enabled() -> bool:
    return envs.CUDA_GRAPHS.get() != "0"


def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to the sequence cap (at most 256)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_blocks_per_seq: int, sizes: list[int],
                 device: torch.device, capture: bool = True):
        """capture=False records nothing and replays by running the model eagerly on the same
        static buffers: every step but the capture itself, for tests without a GPU."""
        from tokstream.kernels.paged_decode_attention import choose_num_splits, device_cores

        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks_per_seq
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int64,
                                        device=device)
        self.context_lens = torch.zeros(largest, dtype=torch.int64, device=device)
        num_kv_heads, _, block_size, _ = kv_caches[0][0].shape
        cores = device_cores(device)
        self.replays = {}
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the largest reserved.
        for size in reversed(self.sizes):
            splits = choose_num_splits(size, num_kv_heads, max_blocks_per_seq * block_size,
                                       cores)
            forward = self._forward(size, splits)
            if not capture:
                self.replays[size] = forward
                continue
            forward()  # warm-up: compiles the kernels, settles the allocator
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward()
            pool = graph.pool()
            self.replays[size] = lambda graph=graph, logits=logits: (graph.replay(), logits)[1]

    def _forward(self, size: int, splits: int):
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_decodes=size,
            decode_block_tables=self.block_tables[:size], decode_key_bias=None, prefills=[],
            decode_context_lens=self.context_lens[:size], decode_num_splits=splits)

        def forward() -> torch.Tensor:
            hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                                meta)  # (size, hidden)
            return self.model.compute_logits(hidden)  # (size, vocab)
        return forward

    def fits(self, meta: AttentionMetadata) -> bool:
        """A decode-only step with a batch and block tables the graphs were captured for."""
        return (not meta.prefills and 0 < meta.num_decodes <= self.sizes[-1]
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The step's logits (num_decodes, vocab), from the graph of the next size up."""
        n = meta.num_decodes
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:size].zero_()
        # Entries past a sequence's end are never read: stale ones may stay.
        self.block_tables[:n, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
        return self.replays[size]()[:n]
