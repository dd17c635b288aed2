"""Token sampling. Randomness is a pure function of (request seed, output position), so a
request that is preempted, or resumed on a restarted replica, continues exactly as if it had
never been interrupted, whatever else shares its batch.

Logits are processed in vLLM's order: the grammar's mask (structured outputs), the allowed
token ids, the bad words, logit_bias, min_tokens' ban on ending, then the penalties (repetition over prompt
and output; frequency and presence over the output), then temperature, min_p, top_k and top_p.
Log-probabilities are the model's own (float32 log-softmax of the raw logits), whatever the
processing, as vLLM and OpenAI report them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokstream.engine.messages.worker import NewRequestData, TokenLogprobs
from tokstream.kernels import cpu_small_ops
from tokstream.sampling_params import SamplingParams
from tokstream.worker.grammar import Constraint

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """Mix (seed, position) into one 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplingRow:
    """One token to sample: its request's settings (as the core sent them) at one position."""

    settings: NewRequestData
    position: int
    """Output index of the token being sampled."""
    prompt_ids: list[int] = field(default_factory=list)
    """The prompt's tokens (kept only when a penalty needs them)."""
    output_ids: list[int] = field(default_factory=list)
    """The output so far (kept only when a penalty or a grammar needs it)."""
    constraint: Constraint | None = None
    """The grammar the next token must follow (structured outputs)."""
    prompt_seen: torch.Tensor | None = None
    """(vocab,) bool: the tokens the prompt holds (prompt_mask), worked out once per request
    for the repetition penalty; None: from prompt_ids."""
    num_drafts: int = 0
    """How many of output_ids' last tokens are drafts being verified in this step."""

    @property
    def params(self) -> SamplingParams:
        return self.settings.params


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """logits (S, vocab) float32 -> one token id per row (logits are left unchanged).

    Sampled rows draw together by inverse CDF: one uniform per row from (seed, position), the
    rows' softmax and running sums in one batched pass (measured at 32 rows over SmolLM2's
    49,152 tokens: 2 ms a step, where per-row Gumbel noise took 17.7 ms). Each row's result
    depends only on its own logits and uniform, never on what shares the batch."""
    plain = [i for i, row in enumerate(rows) if row.params.greedy and not row.params.processed]
    tokens = [0] * len(rows)
    if plain:  # one batched argmax for the rows nothing else touches
        # Over every row: picking the plain ones out first copied them, an op torch splits
        # over the rank's threads (see process).
        best = argmax_rows(logits).tolist()
        for i in plain:
            tokens[i] = best[i]
    drawn: list[int] = []
    warped: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        if row.params.greedy and not row.params.processed:
            continue
        base = process(logits[i], row, eos_token_ids) if row.params.processed else logits[i]
        if row.params.greedy:
            tokens[i] = int(base.numpy().argmax())  # numpy: one thread, as in process
        else:
            drawn.append(i)
            warped.append(warp(base, row))
    if drawn:
        # float32 probabilities (a float64 softmax costs 15x as much), summed in float64
        cdf = torch.softmax(torch.stack(warped), dim=-1).double().cumsum(-1)
        uniform = torch.tensor([[position_uniform(rows[i].settings.seed, rows[i].position)]
                                for i in drawn], dtype=torch.float64)
        picks = torch.searchsorted(cdf, uniform * cdf[:, -1:]).clamp_max(cdf.shape[1] - 1)
        for i, token in zip(drawn, picks[:, 0].tolist()):
            tokens[i] = token
    return tokens


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), through the C kernel on CPU float32 where it is built
    (torch's took 1.9 ms of a 53 ms batch-32 step here; the kernel 0.1 ms)."""
    if cpu_small_ops.supports(logits) and logits.dim() == 2:
        return cpu_small_ops.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in (0, 1] from (seed, position): 0 is excluded, so a token of
    probability 0 at the head of the vocabulary can never be the one drawn."""
    return ((position_seed(seed, position) >> 10) + 1) / 2.0 ** 53


def token_logprobs(logits: torch.Tensor, rows: list[SamplingRow],
                   tokens: list[int]) -> list[TokenLogprobs | None]:
    """The sampled tokens' log-probabilities for the rows that asked (None for the others);
    [] when none did, so a step without them costs nothing."""
    if all(row.params.logprobs is None for row in rows):
        return []
    out: list[TokenLogprobs | None] = []
    for i, row in enumerate(rows):
        num_top = row.params.logprobs
        if num_top is None:
            out.append(None)
            continue
        logprobs = torch.log_softmax(logits[i].float(), dim=-1)
        top = torch.topk(logprobs, num_top) if num_top else None
        out.append(TokenLogprobs(
            float(logprobs[tokens[i]]),
            top.indices.tolist() if top is not None else [],
            top.values.tolist() if top is not None else []))
    return out


def scored_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    num_top: int) -> list[TokenLogprobs]:
    """logits (R, vocab) and the token each row is scored on (R,) -> each target's float32
    log-softmax, its rank in the vocabulary and the num_top most likely tokens (prompt
    logprobs)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, vocab)
    chosen = logprobs.gather(1, targets[:, None])  # (R, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (R,)
    top = torch.topk(logprobs, num_top) if num_top else None
    out = []
    for i, (value, rank) in enumerate(zip(chosen[:, 0].tolist(), ranks.tolist())):
        out.append(TokenLogprobs(value, top.indices[i].tolist() if top is not None else [],
                                 top.values[i].tolist() if top is not None else [], rank))
    return out


def process(logits: torch.Tensor, row: SamplingRow,
            eos_token_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """One row's logits (vocab,) float32 after the grammar's mask, the allowed token ids, the
    bad words, logit_bias, min_tokens' ban on ending (the model's eos_token_ids and the row's stop ids) and the penalties (a new
    tensor).

    In numpy, on one thread, from the copy on: torch splits each vocabulary-sized op (the copy
    itself, the mask, the bias) over the rank's intra-op threads, and on a loaded 2-core
    machine each such op waited for a descheduled thread. Measured for one penalised row
    beside two plain ones over SmolLM2's 49,152 tokens: sample() took 16 ms median with torch's
    copy and argmax on 2 threads, 0.4 ms with 1; every stream in the step waited for it."""
    s = row.params
    out = logits.float().numpy().copy()  # (vocab,)
    if row.constraint is not None:
        allowed = row.constraint.allowed(row.output_ids, row.num_drafts)
        if allowed is not None:
            out[~allowed.numpy()[:out.shape[0]]] = -np.inf
    if s.allowed_token_ids:
        allowed = np.zeros(out.shape[0], dtype=bool)
        allowed[[t for t in s.allowed_token_ids if t < out.shape[0]]] = True
        out[~allowed] = -np.inf
    if s.bad_words_token_ids:
        banned = [words[-1] for words in s.bad_words_token_ids if words[-1] < out.shape[0]
                  and (len(words) == 1 or row.output_ids[-(len(words) - 1):] == words[:-1])]
        out[np.array(banned, dtype=np.int64)] = -np.inf
    if s.logit_bias:
        ids = np.array([t for t in s.logit_bias if t < out.shape[0]], dtype=np.int64)
        out[ids] += np.array([s.logit_bias[t] for t in ids.tolist()], dtype=np.float32)
    if row.position < s.min_tokens:
        ending = np.array([t for t in (*eos_token_ids, *s.stop_token_ids)
                           if t < out.shape[0]], dtype=np.int64)
        kept = out[ending]
        out[ending] = -np.inf
        if not np.isfinite(out).any():  # allowed_token_ids left nothing else: end it may
            out[ending] = kept
    if s.repetition_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
        penalise(out, row)
    return torch.from_numpy(out)


def penalise(values: np.ndarray, row: SamplingRow) -> None:
    """Apply a row's repetition, frequency and presence penalties to its logits (vocab,)
    float32, in place (in numpy, as process explains: p99 108-130 ms with torch's 2 threads
    on the loaded machine, 0.6 ms with 1)."""
    s = row.params
    output = np.asarray(row.output_ids, dtype=np.int64)  # (output,)
    if s.repetition_penalty != 1.0:
        # The prompt's tokens come once per request (prompt_seen); a step adds the output's.
        seen = (row.prompt_seen if row.prompt_seen is not None
                else prompt_mask(row.prompt_ids, values.shape[0])).numpy().copy()  # (vocab,)
        seen[output] = True
        picked = values[seen]
        values[seen] = np.where(picked > 0, picked / np.float32(s.repetition_penalty),
                                picked * np.float32(s.repetition_penalty))
    if (s.frequency_penalty or s.presence_penalty) and output.size:
        counts = np.bincount(output, minlength=values.shape[0])[:values.shape[0]]  # (vocab,)
        values -= (np.float32(s.frequency_penalty) * counts.astype(np.float32)
                   + np.float32(s.presence_penalty) * (counts > 0).astype(np.float32))


def prompt_mask(prompt_ids: list[int], vocab_size: int) -> torch.Tensor:
    """(vocab,) bool: which tokens prompt_ids holds (the repetition penalty's prompt part)."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    if prompt_ids:
        seen[torch.tensor(prompt_ids, dtype=torch.int64)] = True
    return seen


def warp(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """A sampled row's logits (vocab,) after temperature, top_n_sigma, min_p, top_k and top_p:
    the tokens they drop at -inf."""
    s = row.params
    scaled = logits / s.temperature
    if s.top_n_sigma > 0.0:
        finite = scaled[scaled.isfinite()]
        threshold = finite.max() - s.top_n_sigma * finite.std()
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    if s.min_p > 0.0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < s.min_p * probs.max(), float("-inf"))
    if s.top_k > 0 and s.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, s.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled
