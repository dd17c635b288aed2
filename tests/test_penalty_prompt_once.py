"""Issue 31 item 4 (b): a repetition penalty reads its request's prompt once, not on every
step. bench/one_request_cost.py's penalties_long_prompt request made every step it shared
copy its prompt out of the history and hash it into a set; now the prompt's tokens are a
(vocab,) mask worked out at the first sampled token and each step adds only the output's.
Counted: prompt positions read from the history per decode step."""

import random

import torch

from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict
from tokstream.sampling_params import SamplingParams
from tokstream.worker.model import LlamaModel
from tokstream.worker.model_runner import ModelRunner, allocate_kv_caches
from tokstream.worker.sampler import SamplingRow, process, prompt_mask

PENALISED = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5,
                           repetition_penalty=1.3)

BLOCK = 16
PROMPT_TOKENS = 300
DECODE_STEPS = 12


class CountingHistory(list):
    """A request's history that counts how many prompt positions are read out of it."""

    def __init__(self, tokens, num_prompt: int):
        super().__init__(tokens)
        self.num_prompt = num_prompt
        self.prompt_reads = 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            self.prompt_reads += sum(1 for i in range(*index.indices(len(self)))
                                    if i < self.num_prompt)
        elif index < self.num_prompt:
            self.prompt_reads += 1
        return super().__getitem__(index)

    def __iter__(self):
        self.prompt_reads += min(len(self), self.num_prompt)
        return super().__iter__()


def test_a_penalised_request_reads_its_prompt_once():
    source = resolve_model("dummy:tiny")
    torch.manual_seed(0)
    model = LlamaModel(source.config, torch.float32)
    model.load_weights(load_state_dict(source, torch.float32, seed=1))
    caches = allocate_kv_caches(source.config, 64, BLOCK, 1, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, torch.device("cpu"))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(PROMPT_TOKENS)]
    settings = NewRequestData("p", PENALISED, 0, num_prompt_tokens=len(prompt))
    blocks = iter(range(64))
    table = [next(blocks) for _ in range(-(-PROMPT_TOKENS // BLOCK))]
    token = runner.execute(StepPlan(0, [settings], [
        ScheduledChunk("p", prompt, 0, table, 0)])).sampled_token_ids[0]
    state = runner.requests["p"]
    state.history = CountingHistory(state.history, len(prompt))
    output = [token]
    for step in range(1, DECODE_STEPS + 1):
        position = PROMPT_TOKENS + step - 1
        new_blocks = [next(blocks)] if position % BLOCK == 0 else []
        token = runner.execute(StepPlan(step, chunks=[
            ScheduledChunk("p", [token], position, new_blocks, step)])).sampled_token_ids[0]
        output.append(token)
    # Before: the whole prompt was read out on every step (12 x 300 positions).
    assert state.history.prompt_reads == 0, state.history.prompt_reads
    assert state.history[PROMPT_TOKENS:] == output[:-1]
    # The mask gives the logits the prompt's token list gave.
    logits = torch.randn(source.config.vocab_size)
    by_list = process(logits, SamplingRow(settings, 5, prompt, output[:5]))
    by_mask = process(logits, SamplingRow(settings, 5, [], output[:5],
                                          prompt_seen=prompt_mask(prompt, logits.shape[0])))
    assert torch.equal(by_list, by_mask)


def test_penalties_make_no_torch_op_over_the_vocabulary():
    # torch splits each vocabulary-sized op over the rank's intra-op threads; on a loaded
    # 2-core machine each one waited for a descheduled thread (one penalised row's penalties:
    # p99 108-130 ms with 2 threads, 0.6 ms with 1), and every stream in the step waited.
    from torch.overrides import TorchFunctionMode

    vocab = 49152
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(300)]
    output = [rng.randrange(vocab) for _ in range(40)]
    settings = NewRequestData("p", PENALISED, 0, num_prompt_tokens=len(prompt))
    row = SamplingRow(settings, 40, [], output, prompt_seen=prompt_mask(prompt, vocab))
    logits = torch.randn(vocab)

    class CountOps(TorchFunctionMode):
        ops: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountOps.ops.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with CountOps():
        out = process(logits, row)
    # The copy of the logits and numpy views of it and of the prompt's mask: the penalties
    # themselves run in numpy (HEAD's process made 23 torch calls here).
    assert set(CountOps.ops) <= {"clone", "float", "numpy"}, CountOps.ops
    expected = logits.clone()
    for token in set(prompt) | set(output):
        value = expected[token]
        expected[token] = value / 1.3 if value > 0 else value * 1.3
    for token in set(output):
        expected[token] -= 0.5 * output.count(token) + 0.5
    assert torch.allclose(out, expected, atol=1e-5)
