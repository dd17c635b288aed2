"""Issue 33's "a new sampling option is one field plus its use in the sampler", shown with a
real one: top_n_sigma (Top-nσ, Tang et al. 2024). Its request-body bound comes from its field
(test_body_bounds.py covers it with the others); here, what the sampler does with it."""

import numpy as np
import pytest
import torch

from tokstream.engine.messages.worker import NewRequestData
from tokstream.sampling_params import SamplingParams
from tokstream.worker.sampler import SamplingRow, sample, warp

VOCAB = 500


def logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.5


def row(seed: int = 0, position: int = 0, **settings) -> SamplingRow:
    return SamplingRow(NewRequestData("r", SamplingParams(**settings), seed), position)


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_keeps_the_tokens_within_n_sigma_of_the_top(n, temperature):
    scores = logits(int(n * 10))
    scaled = scores.numpy() / temperature
    expected = scaled >= scaled.max() - n * scaled.std(ddof=1)
    kept = torch.isfinite(warp(scores, row(temperature=temperature, top_n_sigma=n))).numpy()
    assert 0 < expected.sum() < VOCAB
    assert np.array_equal(kept, expected)


def test_the_kept_set_does_not_depend_on_temperature():
    scores = logits(3)
    kept = [torch.isfinite(warp(scores, row(temperature=t, top_n_sigma=1.0))) for t in (0.3, 2.0)]
    assert torch.equal(kept[0], kept[1])


def test_zero_is_off():
    scores = logits(4)
    assert torch.isfinite(warp(scores, row(top_n_sigma=0.0))).all()


def test_a_tight_sigma_samples_only_the_top_token():
    scores = logits(5)
    rows = [row(seed=s, position=p, top_n_sigma=0.01) for s in range(4) for p in range(4)]
    assert set(sample(scores.repeat(len(rows), 1), rows)) == {int(scores.argmax())}
    plain = [row(seed=s, position=p) for s in range(4) for p in range(4)]
    assert len(set(sample(scores.repeat(len(plain), 1), plain))) > 1
