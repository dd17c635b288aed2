"""Runs one step plan through the model on this rank: builds the batch tensors, runs the
forward pass over the paged cache, samples. Keeps a little per-request state (block table,
sampling settings) so that the core sends only what changed."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokstream.config import EngineConfig, ModelConfig
from tokstream.engine.messages.worker import (GrammarFailure, NewRequestData, PromptLogprobs,
                                              ScheduledChunk, ScoreRequest, ScoreResult,
                                              StepPlan, StepResult)
from tokstream.worker.attention import AttentionMetadata, PrefillSeq
from tokstream.worker.model import LlamaModel
from tokstream.worker.grammar import Constraint, Grammars
from tokstream.worker.sampler import (SamplingRow, prompt_mask, sample, scored_logprobs,
                                      token_logprobs)
from tokstream.worker import shared_pool
from tokstream.worker.zeroed_memory import lazily_zeroed

log = logging.getLogger("tokstream.worker")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCORE_CHUNK_TOKENS = 1024
"""A score pass runs the sequence through the model this many tokens at a time (chunked
prefill over the lent blocks), so its activations stay bounded whatever the length."""
SCORE_LOGIT_ROWS = 256
"""Rows of (rows, vocab) logits materialised at once while scoring."""
DEFAULT_CPU_KV_MEMORY = 4 * 2**30
"""Default KV pool on CPU when no budget is given (as vLLM's CPU backend defaults to 4 GiB)."""


@dataclass
class PromptRows:
    """One chunk's prompt positions to score (prompt logprobs): hidden rows of the step and
    the prompt token each predicts."""

    request_id: str
    first_index: int
    """Prompt index of the first target."""
    rows: list[int]
    targets: list[int]
    num_top: int


def prompt_rows(chunk: ScheduledChunk, state: "RequestState", query_start: int):
    """The chunk's positions that predict a prompt token, for a request scoring its prompt
    (None otherwise): position p predicts prompt token p + 1, so the last prompt position
    (which predicts the first output token) is not among them."""
    num_top, num_prompt = state.sampling.prompt_logprobs, state.sampling.num_prompt_tokens
    start, n = chunk.start_position, len(chunk.token_ids)
    end = min(start + n, num_prompt - 1)  # positions [start, end) are scored
    if num_top is None or end <= start:
        return None
    following = chunk.token_ids[1:] + ([chunk.next_prompt_token]
                                       if chunk.next_prompt_token is not None else [])
    targets = following[:end - start]
    if len(targets) != end - start:
        raise ValueError(f"request {chunk.request_id}: chunk at {start} lacks the prompt token "
                         "after it (next_prompt_token)")
    rows = list(range(query_start, query_start + end - start))
    return PromptRows(chunk.request_id, start + 1, rows, targets, num_top)


@dataclass
class RequestState:
    sampling: NewRequestData
    block_table: list[int]
    history: list[int] | None = None
    """Every token by position (prompt, then output), for requests whose penalties or grammar
    need it."""
    constraint: Constraint | None = None
    """The grammar's matcher of a constrained request (rank 0 only)."""
    prompt_seen: torch.Tensor | None = None
    """(vocab,) bool: the prompt's tokens for a repetition penalty, worked out at the first
    sampled token (the prompt is whole by then): once, not on every step."""



class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device,
                 swap_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 rank: int = 0, decode_graphs=None, grammars: Grammars | None = None):
        self.model = model
        self.grammars = grammars
        """Matchers for constrained requests (structured outputs); None refuses them."""
        self.decode_graphs = decode_graphs
        """CUDA graphs for decode-only steps (cuda_graphs.DecodeGraphs), or None: eager."""
        self.rank = rank
        """Only rank 0 samples; the other ranks compute their shard and stay silent."""
        self.kv_caches = kv_caches
        self.swap_caches = swap_caches
        """Host copies of the pool's layout with their own block count (swap mode), else None."""
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, RequestState] = {}

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self.update_requests(plan)
        self.swap(plan)
        if not plan.chunks:
            return StepResult(plan.step_id, [])
        input_ids, positions, meta, sample_rows, rows = self.prepare(plan)
        scored, prompt_logprobs = self.prompt_positions(plan), []
        if not scored and self.decode_graphs is not None and self.decode_graphs.fits(meta):
            logits = self.decode_graphs.run(input_ids, positions, meta)[sample_rows]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # (T, hidden)
            logits = self.model.compute_logits(hidden[sample_rows])  # (S, vocab)
            # Prompt logprobs from this same pass's hidden states (every rank: the head's
            # shards are gathered), a bounded number of logit rows at a time.
            prompt_logprobs = [self._score_prompt(hidden, part) for part in scored]
        if self.rank != 0:
            return None
        logits = logits.cpu()
        pending, failures = self.hold_back(rows)
        if pending or failures:  # their rows are left out: nobody waits for their grammar
            held = set(pending) | {failure.request_id for failure in failures}
            kept = [i for i, row in enumerate(rows) if row.settings.request_id not in held]
            logits, rows = logits[kept], [rows[i] for i in kept]  # (S', vocab)
        tokens = sample(logits, rows, self.model.config.eos_token_ids)
        return StepResult(plan.step_id, tokens, time.perf_counter() - started,
                          token_logprobs(logits, rows, tokens), prompt_logprobs,
                          grammar_pending=pending, grammar_failures=failures)

    def hold_back(self, rows: list[SamplingRow]) -> tuple[list[str], list[GrammarFailure]]:
        """The requests among rows not to sample this step: their grammar is still compiling,
        or failed (Grammars.hold_back)."""
        if self.grammars is None or not any(row.constraint is not None for row in rows):
            return [], []
        return self.grammars.hold_back({row.settings.request_id: row.constraint
                                        for row in rows})

    def prompt_positions(self, plan: StepPlan) -> list[PromptRows]:
        """The step's prompt positions to score, per chunk of a request that asked (rows
        counted as prepare lays the chunks out)."""
        scored, query_start = [], 0
        for chunk in plan.chunks:
            part = prompt_rows(chunk, self.requests[chunk.request_id], query_start)
            if part is not None:
                scored.append(part)
            query_start += len(chunk.token_ids)
        return scored

    def _score_prompt(self, hidden: torch.Tensor, part: PromptRows) -> PromptLogprobs:
        scored = []
        for at in range(0, len(part.rows), SCORE_LOGIT_ROWS):
            rows = torch.tensor(part.rows[at:at + SCORE_LOGIT_ROWS], dtype=torch.int64,
                                device=hidden.device)
            logits = self.model.compute_logits(hidden[rows]).cpu()  # (R, vocab)
            targets = torch.tensor(part.targets[at:at + SCORE_LOGIT_ROWS], dtype=torch.int64)
            scored += scored_logprobs(logits, targets, part.num_top)
        return PromptLogprobs(part.request_id, part.first_index, scored)

    @torch.inference_mode()
    def score(self, request: ScoreRequest) -> ScoreResult:
        """Teacher-forced pass: for positions start..n-1 the logit of the given token and the
        top logit, from the hidden state one position earlier. Writes K/V only into the blocks
        lent for this pass."""
        started = time.perf_counter()
        try:
            token_logits, top_logits, top_ids = self._score(request)
        except Exception as exc:  # reported to the core; the worker keeps serving
            log.exception("score pass failed")
            return ScoreResult([], [], [], error=f"{type(exc).__name__}: {exc}")
        return ScoreResult(token_logits, top_logits, top_ids, time.perf_counter() - started)

    def _score(self, request: ScoreRequest):
        bs, n = self.block_size, len(request.token_ids)
        ids = torch.tensor(request.token_ids, dtype=torch.int64, device=self.device)
        table = torch.tensor(request.block_ids, dtype=torch.int64)
        hidden_parts = []
        for begin in range(0, n, SCORE_CHUNK_TOKENS):
            end = min(begin + SCORE_CHUNK_TOKENS, n)
            pos = torch.arange(begin, end)
            meta = AttentionMetadata(
                slot_mapping=(table[pos // bs] * bs + pos % bs).to(self.device), num_decodes=0,
                decode_block_tables=None, decode_key_bias=None,
                prefills=[PrefillSeq(0, end - begin, end, table.to(self.device))])
            hidden_parts.append(self.model(ids[begin:end], pos.to(self.device),
                                           self.kv_caches, meta))  # (chunk, hidden)
        hidden = torch.cat(hidden_parts)[request.start - 1:n - 1]  # (scored, hidden)
        targets = ids[request.start:]  # (scored,)
        token_logits, top_logits, top_ids = [], [], []
        for row in range(0, hidden.shape[0], SCORE_LOGIT_ROWS):
            logits = self.model.compute_logits(hidden[row:row + SCORE_LOGIT_ROWS])  # (R, vocab)
            chosen = targets[row:row + SCORE_LOGIT_ROWS, None]
            token_logits += logits.gather(1, chosen).squeeze(1).tolist()
            top = logits.max(dim=-1)
            top_logits += top.values.tolist()
            top_ids += top.indices.tolist()
        return token_logits, top_logits, top_ids

    def swap(self, plan: StepPlan) -> None:
        """Copy swapped-out blocks to host memory, then swapped-in ones back into the pool.
        Out before in: a pool block freed by a swap-out may be the target of a swap-in."""
        for pairs, out in ((plan.swap_out, True), (plan.swap_in, False)):
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.int64)
            for pool, host in zip(self.kv_caches, self.swap_caches):
                for pool_cache, host_cache in zip(pool, host):
                    # Both (kv_heads, num_blocks, block_size, head_dim): blocks are dim 1.
                    if out:
                        blocks = pool_cache.index_select(1, src.to(self.device))
                        host_cache.index_copy_(1, dst, blocks.cpu())
                    else:
                        blocks = host_cache.index_select(1, src)
                        pool_cache.index_copy_(1, dst.to(self.device), blocks.to(self.device))

    def update_requests(self, plan: StepPlan) -> None:
        """Forget finished requests, learn new ones, extend block tables."""
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            state = self.requests[new.request_id] = RequestState(new, [])
            if state.sampling.params.needs_history:
                state.history = list(new.history)
            if new.params.grammar and self.rank == 0:
                state.constraint = self.grammars.constraint(new.params.grammar)
        for chunk in plan.chunks:
            state = self.requests[chunk.request_id]
            if chunk.kept_blocks is not None:  # blocks of rejected drafts went back
                del state.block_table[chunk.kept_blocks:]
            state.block_table.extend(chunk.new_block_ids)
            if state.history is not None:  # by position: a re-sent chunk overwrites
                del state.history[chunk.start_position:]
                state.history.extend(chunk.token_ids)

    def prepare(self, plan: StepPlan):
        """The step's tensors: input ids, positions (T,), attention metadata, the rows to
        sample from and their sampling settings."""
        bs = self.block_size
        input_ids: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        sample_rows: list[int] = []
        rows: list[SamplingRow] = []
        # Positions and slots as plain ints, one tensor each at the end: per chunk tensor ops
        # took 1.7 ms of a 32-sequence step (SmolLM2, Zen 3), for a few ints each.
        positions: list[int] = []
        slots: list[int] = []
        in_decode_prefix = True
        for chunk in plan.chunks:
            state = self.requests[chunk.request_id]
            start, n = chunk.start_position, len(chunk.token_ids)
            query_start = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            table = state.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            # One-token chunks at the head of the plan share one batched decode attention, and
            # so do verify chunks (a last token and its drafts): one decode row per position,
            # seeing its causal prefix, the drafts before it included (every row's K/V is
            # written before attention). A verify-only step is then decode-only: the one-call
            # decode stack takes it (decode_stack.py).
            in_decode_prefix = in_decode_prefix and n == 1 + chunk.num_draft_tokens
            if in_decode_prefix:
                decode_tables.extend([state.block_table] * n)
                decode_lens.extend(range(start + 1, start + n + 1))
            else:
                prefills.append(PrefillSeq(query_start, n, start + n,
                                           torch.tensor(table, dtype=torch.int64,
                                                        device=self.device)))
            if chunk.sample_index is not None:
                history, num_prompt = state.history or [], state.sampling.num_prompt_tokens
                if state.sampling.params.repetition_penalty != 1.0 and state.prompt_seen is None:
                    state.prompt_seen = prompt_mask(history[:num_prompt],
                                                    self.model.config.vocab_size)
                # With drafts, one row after each of the last 1 + k positions: row i samples
                # output index sample_index + i as if the drafts before it were the output.
                last = n - 1 - chunk.num_draft_tokens
                for i in range(chunk.num_draft_tokens + 1):
                    sample_rows.append(query_start + last + i)
                    rows.append(SamplingRow(state.sampling, chunk.sample_index + i, [],
                                            history[num_prompt:start + last + i + 1],
                                            state.constraint, state.prompt_seen, i))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decodes=len(decode_tables),
            decode_block_tables=None, decode_key_bias=None, prefills=prefills)
        if decode_tables:
            max_blocks = max(len(t) for t in decode_tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.int64, device=self.device)
            if self.model.backend.needs_key_bias:
                key_pos = torch.arange(max_blocks * bs)
                past_end = key_pos[None, :] >= torch.tensor(decode_lens)[:, None]
                bias = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
                meta.decode_key_bias = bias.to(self.device)
            meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.int64,
                                                    device=self.device)
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device), meta,
                torch.tensor(sample_rows, dtype=torch.int64, device=self.device), rows)


def kv_pool_blocks(config: EngineConfig, model_config: ModelConfig, dtype: str,
                   device: torch.device, shared: bool = False) -> tuple[int, int]:
    """(num_blocks, bytes per block on this rank) from the memory budget. shared: the pool
    is in the gateway's pool files (engine/recovery/pool_files.py), which every group maps,
    the spare group and the spare core's too, so the budget need not be split between them."""
    per_token = model_config.kv_bytes_per_token(dtype) // config.tp
    per_block = per_token * config.cache.block_size
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks, per_block
    budget = config.cache.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            # Each rank has a device of its own: its share is a fraction of that device.
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.cache.memory_fraction)
        else:
            # Every rank (and the spares') shares host memory: the budget is the replica's.
            import psutil
            available = psutil.virtual_memory().available
            groups = 1 if shared else 1 + config.spare + config.spare_core
            budget = min(DEFAULT_CPU_KV_MEMORY,
                         int(available * config.cache.memory_fraction) // groups) // config.tp
        # Without an explicit budget, stop at what the sequence cap could ever fill.
        blocks_per_seq = -(-model_config.max_position // config.cache.block_size)
        budget = min(budget, config.scheduler.max_num_seqs * blocks_per_seq * per_block)
    else:
        budget //= config.tp  # the budget is per replica
    return max(1, budget // per_block), per_block


def allocate_swap_space(model_config: ModelConfig, num_blocks: int, block_size: int, tp: int,
                        dtype: torch.dtype, pin: bool):
    """Host buffers in the pool's layout for swapped-out blocks; pinned when the pool is on a
    GPU so copies can use DMA. Left uninitialised: only swapped-out blocks are ever read."""
    shape = kv_cache_shape(model_config, num_blocks, block_size, tp)
    return [(torch.empty(shape, dtype=dtype, pin_memory=pin),
             torch.empty(shape, dtype=dtype, pin_memory=pin))
            for _ in range(model_config.num_layers)]


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int,
                   tp: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) on one rank: (kv_heads / tp, num_blocks, block_size, head_dim)."""
    return (model_config.num_kv_heads // tp, num_blocks, block_size, model_config.head_dim)


def map_shared_pool(pool_file: str, model_config: ModelConfig, num_blocks: int,
                    block_size: int, tp: int, dtype: torch.dtype):
    """This rank's pool file, mapped (shared_pool.py); None if unusable."""
    shape = kv_cache_shape(model_config, num_blocks, block_size, tp)
    nbytes = shared_pool.pool_bytes(2 * model_config.num_layers, shape, dtype)
    return shared_pool.map_pool_file(pool_file, nbytes)


def allocate_kv_caches(model_config: ModelConfig, num_blocks: int, block_size: int,
                       tp: int, dtype: torch.dtype, device: torch.device, shared=None):
    """[(K, V)] per layer (kv_cache_shape); on the host inside shared (map_shared_pool) when
    given, else in memory of this process's own."""
    shape = kv_cache_shape(model_config, num_blocks, block_size, tp)
    count = 2 * model_config.num_layers
    # Zeroed, not empty: padded gathers read unused slots, and NaN garbage would leak through
    # a zero attention weight. On the host, zeros the kernel supplies as pages are first
    # written, so a start (a restart after a fault too) does not wait on writing the pool.
    if device.type != "cpu":
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    elif shared is not None:
        tensors = shared_pool.carve(shared, count, shape, dtype)
    else:
        tensors = [lazily_zeroed(shape, dtype) for _ in range(count)]
    return list(zip(tensors[0::2], tensors[1::2]))
