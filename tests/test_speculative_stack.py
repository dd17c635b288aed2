"""A speculative verify step runs in the one-call decode stack (issue 34): the model runner lays
a verify chunk (a last token and its drafts) out as one decode row per position, each attending
to its causal prefix, so a step of decodes and verify chunks is decode-only. On native GGUF
weights the stack then takes it, computes the per-layer path's logits bit for bit, and both
equal one plain causal pass over the sequence; the step samples after each verified position."""

import pytest
import torch

from helpers.prefill import prefill_logits
from test_decode_stack import BLOCK_SIZE, give_int16, native_model, random_caches
from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
from tokstream.kernels import cpu_decode_stack
from tokstream.sampling_params import SamplingParams
from tokstream.worker.decode_stack import stack_for_step
from tokstream.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_decode_stack.load() is None, reason="no C compiler here")

PROMPT = [(11 * i + 5) % 90 + 3 for i in range(9)]
OTHER = [(7 * i + 2) % 90 + 3 for i in range(6)]
T0, DRAFTS = 41, [42, 43, 44]


def greedy(request_id: str, num_prompt: int) -> NewRequestData:
    return NewRequestData(request_id, SamplingParams(temperature=0.0), 0,
                          num_prompt_tokens=num_prompt)


def runner_after_prefill(model) -> ModelRunner:
    """Both prompts prefilled (per-layer path) into caches full of random values, so a row
    reading a slot past its context shows."""
    runner = ModelRunner(model, random_caches(0), BLOCK_SIZE, torch.device("cpu"))
    runner.execute(StepPlan(1, [greedy("r", len(PROMPT)), greedy("o", len(OTHER))], [
        ScheduledChunk("r", PROMPT, 0, [7, 3, 12], 0),
        ScheduledChunk("o", OTHER, 0, [20, 25], 0)]))
    return runner


# A decode of "o", then "r"'s last token and three drafts at positions 9-12 (a fourth block).
VERIFY = StepPlan(2, chunks=[ScheduledChunk("o", [55], 6, [], 1),
                             ScheduledChunk("r", [T0, *DRAFTS], 9, [30], 1, num_draft_tokens=3)])


def cloned(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.mark.parametrize("int16", [False, True], ids=["fused", "int16"])
def test_a_verify_step_runs_in_the_stack_as_the_layers_would(int16, monkeypatch):
    model = native_model()
    if int16:
        give_int16(model)  # the step's five rows take the int16 products
    runner = runner_after_prefill(model)
    runner.update_requests(VERIFY)
    input_ids, positions, meta, sample_rows, rows = runner.prepare(VERIFY)
    assert not meta.prefills and meta.num_decodes == 5
    assert meta.decode_context_lens.tolist() == [7, 10, 11, 12, 13]  # each row's causal prefix
    assert stack_for_step(model, 5, runner.kv_caches, meta) is not None
    assert sample_rows.tolist() == [0, 1, 2, 3, 4]
    assert [row.position for row in rows] == [1, 1, 2, 3, 4]

    def forward(fused: bool):
        model.fused_decode = fused
        caches = cloned(runner.kv_caches)
        with torch.inference_mode():
            logits = model.compute_logits(model(input_ids, positions, caches, meta))
        return logits, caches

    per_layer, per_layer_caches = forward(False)
    fused, fused_caches = forward(True)
    assert torch.equal(fused, per_layer), (fused - per_layer).abs().max()
    for (k0, v0), (k1, v1) in zip(per_layer_caches, fused_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # the same keys and values written
    # Both are one causal pass over the sequence (the verified positions' last rows), within
    # rounding: int16 products round each activation row to 16 bits, which the prefill's
    # slightly different keys and values can tip the other way.
    atol = 1e-3 if int16 else 1e-4
    expected = prefill_logits(model, PROMPT + [T0, *DRAFTS], BLOCK_SIZE)[-4:]  # (4, vocab)
    assert torch.allclose(fused[1:], expected, atol=atol), (fused[1:] - expected).abs().max()
    expected_o = prefill_logits(model, OTHER + [55], BLOCK_SIZE)[-1]
    assert torch.allclose(fused[0], expected_o, atol=atol), (fused[0] - expected_o).abs().max()

    # The runner's own step: one stack call, and the greedy token after each position.
    calls = []
    run = cpu_decode_stack.DecodeStack.run
    monkeypatch.setattr(cpu_decode_stack.DecodeStack, "run",
                        lambda self, *args: calls.append(args[0].shape[0]) or run(self, *args))
    model.fused_decode = True
    runner.requests["r"].block_table.pop()  # execute extends the table again
    result = runner.execute(VERIFY)
    assert calls == [5]
    assert result.sampled_token_ids == per_layer.argmax(-1).tolist()
