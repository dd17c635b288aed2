"""The logits processing behind the OpenAI/vLLM sampling parameters, against Hugging Face's
logits processors on the same logits (repetition_penalty, min_p, temperature/top_k/top_p) and
against OpenAI's documented formula (frequency/presence penalties, logit_bias); the
log-probabilities; and the parameters' validation."""

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from tokstream.engine.messages.worker import NewRequestData
from tokstream.errors import UserInputError
from tokstream.sampling_params import SamplingParams
from tokstream.worker.sampler import SamplingRow, process, sample, token_logprobs, warp

VOCAB = 64


def row(position=0, prompt_ids=(), output_ids=(), **settings) -> SamplingRow:
    seed = settings.pop("seed", 1)
    return SamplingRow(NewRequestData("r", SamplingParams(**settings), seed), position,
                       list(prompt_ids), list(output_ids))


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_hugging_faces(penalty):
    scores = logits()
    prompt, output = [3, 5, 5, 9], [9, 12, 3, 40]
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]),
                                                   scores[None].clone())[0]
    ours = process(scores, row(repetition_penalty=penalty, prompt_ids=prompt,
                               output_ids=output))
    assert torch.allclose(ours, hf)
    assert not torch.equal(ours, scores)


def test_frequency_and_presence_penalties_are_openais():
    scores = logits(1)
    output = [7, 7, 7, 2, 30]
    ours = process(scores, row(frequency_penalty=0.5, presence_penalty=1.25, prompt_ids=[7, 8],
                               output_ids=output))
    expected = scores.clone()
    for token in set(output):  # mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence
        expected[token] -= output.count(token) * 0.5 + 1.25
    assert torch.allclose(ours, expected)
    assert ours[8] == scores[8]  # prompt tokens are not the output's


def test_logit_bias_adds_to_the_named_tokens():
    scores = logits(2)
    ours = process(scores, row(logit_bias={4: 100.0, 10: -100.0, 10_000: 5.0}))
    assert ours[4] == scores[4] + 100 and ours[10] == scores[10] - 100
    assert sample(scores[None], [row(temperature=0.0, logit_bias={4: 100.0})]) == [4]


def test_min_tokens_bans_ending_until_reached():
    scores = logits(3)
    scores[2] = scores[7] = 50.0  # the model's end (2) and the row's stop id (7) lead
    settings = dict(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    banned = scores.clone()
    banned[[2, 7]] = -math.inf
    for position in (0, 1):  # output tokens 1 and 2: the best of the others
        assert sample(scores[None], [row(position, **settings)], eos_token_ids=(2,)) == \
            [int(banned.argmax())]
    assert sample(scores[None], [row(2, **settings)], eos_token_ids=(2,)) in ([2], [7])
    # Only ending ids allowed: min_tokens cannot hold them back (nothing else is left).
    only_end = dict(temperature=1.0, min_tokens=2, allowed_token_ids=[2])
    assert sample(scores[None], [row(0, **only_end)], eos_token_ids=(2,)) == [2]
    allowed = dict(temperature=1.0, allowed_token_ids=[5, 9])
    assert {sample(scores[None], [row(p, seed=p, **allowed)])[0] for p in range(40)} == {5, 9}
    with pytest.raises(UserInputError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_a_bad_words_last_token_is_banned_only_after_the_rest():
    scores = logits(4)
    scores[9] = 50.0  # the leader, the last token of both bad sequences
    settings = dict(temperature=0.0, bad_words_token_ids=[[3, 9], [5, 6, 9]])
    assert sample(scores[None], [row(0, output_ids=[1], **settings)]) == [9]
    assert sample(scores[None], [row(1, output_ids=[1, 3], **settings)]) != [9]
    assert sample(scores[None], [row(2, output_ids=[5, 6], **settings)]) != [9]
    assert sample(scores[None], [row(2, output_ids=[6, 6], **settings)]) == [9]
    alone = dict(temperature=0.0, bad_words_token_ids=[[9]])
    assert sample(scores[None], [row(0, **alone)]) != [9]
    assert SamplingParams(**settings).needs_history
    assert not SamplingParams(**alone).needs_history


@pytest.mark.parametrize("min_p", [0.05, 0.3])
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_min_p_after_temperature_is_hugging_faces(min_p, temperature):
    scores = logits(3)
    hf = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, scores[None]))
    ours = warp(scores, row(temperature=temperature, min_p=min_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(hf[0]))
    kept = ~torch.isinf(ours)
    assert torch.allclose(ours[kept], hf[0][kept])
    assert 1 < int(kept.sum()) < VOCAB


def test_top_k_and_top_p_are_hugging_faces():
    scores = logits(4)
    hf = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(20)(None, scores[None] / 0.9))
    ours = warp(scores, row(temperature=0.9, top_k=20, top_p=0.8))
    assert torch.equal(torch.isinf(ours), torch.isinf(hf[0]))


def test_logprobs_are_the_raw_log_softmax():
    scores = torch.stack([logits(5), logits(6)])
    rows = [row(temperature=0.0, logprobs=3, logit_bias={0: 50.0}), row(temperature=0.0)]
    tokens = sample(scores, rows)
    out = token_logprobs(scores, rows, tokens)
    reference = torch.log_softmax(scores[0], -1)
    assert tokens[0] == 0  # the bias chose it, the log-probability stays the model's
    assert math.isclose(out[0].logprob, float(reference[0]), rel_tol=1e-6)
    assert out[0].top_token_ids == torch.topk(reference, 3).indices.tolist()
    assert out[1] is None
    assert token_logprobs(scores, [row(), row()], tokens) == []  # none asked: nothing


def test_a_seeded_sample_is_unchanged_by_the_processing_path():
    """A row with no penalty samples exactly as before the processors existed."""
    scores = logits(7)
    plain = sample(scores[None], [row(temperature=0.8, seed=5)])
    zero = sample(scores[None], [row(temperature=0.8, seed=5, logit_bias={1: 0.0})])
    assert plain == zero


@pytest.mark.parametrize("settings", [
    {"min_p": 1.5}, {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {5: 101.0}}, {"logprobs": 21}, {"logprobs": True}])
def test_out_of_range_settings_are_refused(settings):
    with pytest.raises(UserInputError):
        SamplingParams(**settings)


def test_draws_follow_the_distribution():
    """Inverse-CDF draws over 4,000 positions land on each token at its probability, and
    never on one the warping removed."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    scores = torch.log(probs)[None]  # the last token has probability 0 (-inf)
    counts = torch.zeros(4)
    for position in range(4000):
        counts[sample(scores, [row(seed=11, position=position)])[0]] += 1
    assert counts[3] == 0
    assert torch.allclose(counts / 4000, probs, atol=0.03), counts / 4000
    # The same rows in one batch, mixed with greedy ones, draw the same tokens.
    rows = [row(seed=11, position=p) for p in range(8)] + [row(temperature=0.0)]
    batch = sample(scores.expand(9, 4), rows)
    assert batch[:8] == [sample(scores, [r])[0] for r in rows[:8]] and batch[8] == 0
