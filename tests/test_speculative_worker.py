"""The worker's side of speculative decoding (issue 34), on a tiny random Llama: a chunk with
drafts samples after each of its last 1 + k positions, each row with its own output index and
the output as plain decoding would have it there (the drafts before it, for penalties), its
logits those of one plain causal pass; and kept_blocks gives back a rejected tail."""

import random

import pytest
import torch

from helpers.prefill import prefill_logits
from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict
from tokstream.sampling_params import SamplingParams
from tokstream.worker.model import LlamaModel
from tokstream.worker.model_runner import ModelRunner, allocate_kv_caches

BLOCK = 4


@pytest.fixture(scope="module")
def model():
    source = resolve_model("dummy:tiny")
    m = LlamaModel(source.config, torch.float32)
    m.load_weights(load_state_dict(source, torch.float32, seed=1))
    return m


def test_a_chunk_with_drafts_samples_after_each_position(model):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 512) for _ in range(9)]
    other = [rng.randrange(3, 512) for _ in range(6)]
    t0, drafts = 77, [78, 79, 80]
    caches = allocate_kv_caches(model.config, 32, BLOCK, 1, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, torch.device("cpu"))
    penalised = NewRequestData("r", SamplingParams(temperature=0.0, frequency_penalty=0.5), 0,
                               num_prompt_tokens=len(prompt))
    plain = NewRequestData("o", SamplingParams(temperature=0.0), 0)
    runner.execute(StepPlan(1, [penalised, plain], [
        ScheduledChunk("r", prompt, 0, [3, 9, 4], 0),
        ScheduledChunk("o", other, 0, [11, 12], 0)]))
    # A plain decode of "o" first, then "r"'s last token and three drafts (positions 9-12).
    plan = StepPlan(2, chunks=[
        ScheduledChunk("o", [55], 6, [], 1),
        ScheduledChunk("r", [t0, *drafts], 9, [20], 1, num_draft_tokens=3)])
    runner.update_requests(plan)
    input_ids, positions, meta, sample_rows, rows = runner.prepare(plan)
    assert sample_rows.tolist() == [0, 1, 2, 3, 4]  # o's one row, then all four of r's
    assert [row.position for row in rows] == [1, 1, 2, 3, 4]
    assert [row.output_ids for row in rows[1:]] == [[t0], [t0, 78], [t0, 78, 79],
                                                    [t0, 78, 79, 80]]
    # No row copies the prompt out (a repetition penalty reads it once: RequestState.prompt_seen).
    assert all(row.prompt_ids == [] for row in rows[1:])
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, caches, meta)[sample_rows])
    expected = prefill_logits(model, prompt + [t0, *drafts], BLOCK)[-4:]  # (4, vocab)
    assert torch.allclose(logits[1:], expected, atol=1e-4), (logits[1:] - expected).abs().max()
    assert torch.allclose(logits[0], prefill_logits(model, other + [55], BLOCK)[-1], atol=1e-4)


def test_kept_blocks_drops_a_rejected_tail_before_new_blocks():
    runner = ModelRunner(None, [], BLOCK, torch.device("cpu"))
    runner.update_requests(StepPlan(1, [NewRequestData("r", SamplingParams(temperature=0.0), 0)], [
        ScheduledChunk("r", list(range(7)), 0, [5, 6], 0)]))
    runner.update_requests(StepPlan(2, chunks=[
        ScheduledChunk("r", [1, 2, 3, 4, 5], 7, [8, 2], 1, num_draft_tokens=4, kept_blocks=2)]))
    assert runner.requests["r"].block_table == [5, 6, 8, 2]
    # Two drafts accepted: positions 0-9 kept, block 2 (positions 12-15) went back.
    runner.update_requests(StepPlan(3, chunks=[
        ScheduledChunk("r", [9], 10, [], 3, kept_blocks=3)]))
    assert runner.requests["r"].block_table == [5, 6, 8]
