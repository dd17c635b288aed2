"""Issue 31 item 4: a row with logit_bias, penalties or a grammar costs its batch no torch op
over the vocabulary. torch splits each such op (a copy of the row, a mask, an argmax) over
the rank's intra-op threads, and on a loaded 2-core machine each waited for a descheduled
thread: one penalised row beside two plain ones made sample() take 16 ms median (0.4 ms on
one thread), and every stream in the step waited. The processed row's work is numpy's, on one
thread. Counted, never timed; the logits are those of the torch reference, bit for bit."""

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tokstream.engine.messages.worker import NewRequestData
from tokstream.sampling_params import SamplingParams
from tokstream.worker.sampler import SamplingRow, process, prompt_mask, sample

VOCAB = 49152  # SmolLM2's


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)


class VocabWork(TorchFunctionMode):
    """Records each torch call that reads a vocabulary-sized tensor and returns a tensor that is
    not a view of it (a copy, a mask, a reduction): work torch may split over threads."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        read = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))
                if t.numel() >= VOCAB}
        made = list(tensors(result))
        if read and any(t.untyped_storage().data_ptr() not in read for t in made):
            self.calls.append(getattr(func, "__name__", str(func)))
        return result


class FixedGrammar:
    """A grammar's constraint as the sampler sees it: the tokens allowed next."""

    def __init__(self, allowed: torch.Tensor):
        self.mask = allowed

    def allowed(self, output_ids, num_drafts=0):
        return self.mask


def reference(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The processing in torch, as sampler.process did it before it moved to numpy."""
    s = row.params
    out = logits.clone()
    if row.constraint is not None:
        out.masked_fill_(~row.constraint.allowed(row.output_ids), float("-inf"))
    if s.logit_bias:
        ids = torch.tensor([t for t in s.logit_bias if t < out.shape[0]], dtype=torch.int64)
        out.index_add_(0, ids, torch.tensor([s.logit_bias[t] for t in ids.tolist()]))
    output = torch.tensor(row.output_ids, dtype=torch.int64)
    if s.repetition_penalty != 1.0:
        seen = row.prompt_seen.clone()
        seen[output] = True
        picked = out[seen]
        out[seen] = torch.where(picked > 0, picked / torch.tensor(s.repetition_penalty),
                                picked * torch.tensor(s.repetition_penalty))
    if (s.frequency_penalty or s.presence_penalty) and len(output):
        counts = torch.bincount(output, minlength=VOCAB).float()
        out -= (torch.tensor(s.frequency_penalty) * counts
                + torch.tensor(s.presence_penalty) * (counts > 0).float())
    return out


def processed_row(kind: str, rng: random.Random) -> SamplingRow:
    prompt = [rng.randrange(VOCAB) for _ in range(1200)]
    output = [rng.randrange(VOCAB) for _ in range(60)] + [7] * 5
    if kind == "penalties":
        params = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=1.5,
                                repetition_penalty=1.3)
    elif kind == "logit_bias":
        params = SamplingParams(temperature=0.0, logit_bias={
            t: rng.choice([-2.0, -1.0, 1.0, 2.0]) for t in rng.sample(range(VOCAB), 300)})
    else:
        params = SamplingParams(temperature=0.0, grammar='{"type": "json_schema"}')
    allowed = torch.tensor([rng.random() < 0.3 for _ in range(VOCAB)])
    return SamplingRow(NewRequestData(kind, params, 3), len(output), [], output,
                       FixedGrammar(allowed) if kind == "grammar" else None,
                       prompt_mask(prompt, VOCAB))


@pytest.mark.parametrize("kind", ["penalties", "logit_bias", "grammar"])
def test_a_processed_row_makes_no_torch_op_over_the_vocabulary(kind):
    rng = random.Random(kind)
    plain = SamplingParams(temperature=0.0)
    rows = [SamplingRow(NewRequestData("a", plain, 1), 5), processed_row(kind, rng),
            SamplingRow(NewRequestData("b", plain, 2), 9)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 4
    with VocabWork() as work:
        tokens = sample(logits, rows)
        out = process(logits[1], rows[1])
    # HEAD's sampler copied the row (clone), masked it (bitwise_not), copied the plain rows
    # out (__getitem__) and took the processed row's argmax in torch.
    assert work.calls == [], work.calls
    expected = reference(logits[1], rows[1])
    assert torch.equal(out, expected)
    assert tokens == [int(logits[0].argmax()), int(expected.argmax()), int(logits[2].argmax())]


def test_a_sampled_processed_row_draws_from_the_processed_logits():
    rng = random.Random(5)
    row = processed_row("logit_bias", rng)
    row.settings = NewRequestData("s", SamplingParams(temperature=0.8, seed=3, logit_bias={
        11: 100.0}), 3)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6))
    assert sample(logits, [row]) == [11]
