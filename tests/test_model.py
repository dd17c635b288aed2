"""The torch model over the paged cache, on a tiny random Llama: chunked prefill, decode and
mixed batches must give the logits of one plain causal pass, whatever the block layout."""

import random

import pytest
import torch

from helpers.prefill import prefill_logits
from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
from tokstream.model.presets import dummy_config
from tokstream.model.weights import load_state_dict
from tokstream.model.source import resolve_model
from tokstream.sampling_params import SamplingParams
from tokstream.worker.attention import AttentionMetadata, paged_attention, write_kv
from tokstream.worker.model import LlamaModel
from tokstream.worker.model_runner import ModelRunner, allocate_kv_caches
from tokstream.worker.sampler import SamplingRow, position_seed, sample

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    source = resolve_model("dummy:tiny")
    m = LlamaModel(source.config, torch.float32)
    m.load_weights(load_state_dict(source, torch.float32, seed=1))
    return m


def dense_logits(model, tokens):
    """Reference: one fresh causal pass over the whole sequence."""
    return prefill_logits(model, tokens, BLOCK)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_paged_attention_matches_dense_attention(use_kernels):
    torch.manual_seed(0)
    heads, kv_heads, dim, num_blocks = 4, 2, 8, 16
    k_cache = torch.zeros(kv_heads, num_blocks, BLOCK, dim)
    v_cache = torch.zeros_like(k_cache)
    lengths = [5, 9, 1]
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables, full_k, full_v = [], [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        tables.append(table)
        k, v = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        write_kv(k_cache, v_cache, k, v, slots)
        full_k.append(k)
        full_v.append(v)
    q = torch.randn(len(lengths), heads, dim)
    max_blocks = max(map(len, tables))
    meta = AttentionMetadata(
        torch.empty(0, dtype=torch.int64), len(lengths),
        torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
        torch.zeros(len(lengths), max_blocks * BLOCK).masked_fill_(
            torch.arange(max_blocks * BLOCK)[None] >= torch.tensor(lengths)[:, None], float("-inf")),
        [], decode_context_lens=torch.tensor(lengths), use_kernels=use_kernels)
    out = paged_attention(q, None, None, k_cache, v_cache, meta, dim ** -0.5)
    for i, n in enumerate(lengths):
        k = full_k[i].repeat_interleave(heads // kv_heads, dim=1)  # (n, heads, dim)
        v = full_v[i].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], k) * dim ** -0.5
        expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
        assert torch.allclose(out[i], expected, atol=1e-5)


def run_sequence(model, tokens, chunk_sizes, decode_from):
    """Prefill tokens[:decode_from] in the given chunks, then decode one token at a time,
    with a shuffled block table; return the logits at every position."""
    caches = allocate_kv_caches(model.config, 32, BLOCK, 1, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, torch.device("cpu"))
    free = list(range(32))
    random.Random(len(tokens)).shuffle(free)
    table: list[int] = []
    logits = []
    pos = 0
    sizes = list(chunk_sizes) + [1] * (len(tokens) - decode_from)
    for step, size in enumerate(sizes):
        needed = -(-(pos + size) // BLOCK) - len(table)
        new_blocks = [free.pop() for _ in range(needed)]
        table += new_blocks
        new = [NewRequestData("r", GREEDY, 0)] if step == 0 else []
        plan = StepPlan(step, new_requests=new,
                        chunks=[ScheduledChunk("r", tokens[pos:pos + size], pos, new_blocks, None)])
        runner.update_requests(plan)
        input_ids, positions, meta, _, _ = runner.prepare(plan)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(input_ids, positions, caches, meta)))
        pos += size
    return torch.cat(logits)


@pytest.mark.parametrize("chunks,decode_from", [((13,), 13), ((5, 3, 5), 13), ((1,), 1), ((8,), 8)])
def test_chunked_prefill_and_decode_match_one_pass(model, chunks, decode_from):
    tokens = [random.Random(7).randrange(3, 512) for _ in range(20)]
    expected = dense_logits(model, tokens)
    got = run_sequence(model, tokens, chunks, decode_from)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_mixed_batch_matches_separate_runs(model):
    """Two decodes and a prefill chunk in one step give each sequence its own logits."""
    rng = random.Random(3)
    seqs = {name: [rng.randrange(3, 512) for _ in range(n)] for name, n in
            (("a", 9), ("b", 6), ("c", 7))}
    caches = allocate_kv_caches(model.config, 32, BLOCK, 1, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, torch.device("cpu"))
    free = list(range(32))
    rng.shuffle(free)
    # Step 1: prefill a[:8] and b[:5].
    tables = {"a": [free.pop() for _ in range(2)], "b": [free.pop() for _ in range(2)]}
    plan = StepPlan(1, [NewRequestData(n, GREEDY, 0) for n in "ab"], [
        ScheduledChunk("a", seqs["a"][:8], 0, tables["a"], 0),
        ScheduledChunk("b", seqs["b"][:5], 0, tables["b"], 0)])
    runner.execute(plan)
    # Step 2: decode a[8] and b[5] while prefilling all of c.
    tables["a"].append(free.pop())
    tables["c"] = [free.pop() for _ in range(2)]
    plan = StepPlan(2, [NewRequestData("c", GREEDY, 0)], [
        ScheduledChunk("a", seqs["a"][8:9], 8, tables["a"][2:], 1),
        ScheduledChunk("b", seqs["b"][5:6], 5, [], 1),
        ScheduledChunk("c", seqs["c"], 0, tables["c"], 0)])
    runner.update_requests(plan)
    input_ids, positions, meta, rows, _ = runner.prepare(plan)
    assert meta.num_decodes == 2
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, caches, meta)[rows])
    for i, name in enumerate("abc"):
        expected = dense_logits(model, seqs[name])[-1]
        assert torch.allclose(logits[i], expected, atol=1e-4), name


def row(temperature, top_p, top_k, seed, position) -> SamplingRow:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    return SamplingRow(NewRequestData("r", params, seed), position)


def test_sampling_is_a_pure_function_of_seed_and_position():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    rows = [row(0.8, 0.9, 50, 1234, p) for p in (0, 5, 5)]
    first = sample(logits, rows)
    assert sample(logits, rows) == first
    assert sample(logits[[1]], [rows[1]]) == [first[1]]  # batch composition does not matter
    assert position_seed(1, 0) != position_seed(1, 1) != position_seed(2, 0)


def test_sampling_respects_top_k_top_p_and_greedy():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0, 1.0]])
    assert sample(logits, [row(0.0, 1.0, 0, 0, 0)]) == [1]
    # Temperature is capped at 2 (the widest API bound): flatter logits stand in for hotter ones.
    seen_k = {sample(logits / 2.5, [row(2.0, 1.0, 2, 0, p)])[0] for p in range(200)}
    assert seen_k == {1, 2}
    seen_p = {sample(logits, [row(1.0, 0.5, 0, 0, p)])[0] for p in range(200)}
    assert seen_p == {1}
    seen_all = {sample(logits / 5, [row(2.0, 1.0, 0, 0, p)])[0] for p in range(300)}
    assert seen_all == {0, 1, 2, 3, 4}
