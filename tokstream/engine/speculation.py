"""Speculative decoding in the engine core (issue 34): which requests draft, their drafts, how
many of a draft the model accepted, and the counts /metrics and /v1/state show. Pure Python,
no torch.

A running request that decodes with drafts d1..dk computes its last token and the k drafts in
one chunk of 1 + k positions; the rank samples a token after each of them (t0..tk), each at
its own output index with the request's own settings. d(i+1) is accepted while it equals
t(i): the request then gains t0..ta, where a drafts were accepted, and keeps the K/V of its
last token and of those a drafts; the other positions are rolled back (scheduler.update).

Why that is exact, sampled requests included: a token is a pure function of the logits and
(seed, output index) (worker/sampler.py). While every draft before position i was accepted,
position i saw exactly the tokens plain decoding would have fed it, so t(i) is the token
plain decoding samples there; the first t(i) that differs from the draft is still that
token, and everything after it is discarded. The output is the same token for token, not
only the same distribution. (Rejection sampling would accept more of a sampled request's
drafts; this accepts a draft only where the sample happens to equal it.)

With --speculative auto a request drafts only as many tokens as its recent acceptance says
pay for their rows at the step's batch (draft_length.py); ngram drafts all it may.

Penalties and grammars see, at each row, the output as plain decoding would have it there
(the drafts before the row: model_runner keeps the history by position, and a grammar's
matcher follows the rows and rolls back to what was kept, worker/grammar.py), and each row's
log-probabilities are the model's for the token sampled there, so all of them are covered. A
draft the grammar refuses is never accepted: the row before it samples from a mask without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokstream.config import SpeculativeConfig
from tokstream.engine.draft_length import DraftLengths, StepPrice
from tokstream.engine.ngram_drafter import NgramConfig, NgramDrafter
from tokstream.engine.request import Request


def num_accepted(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """Drafts accepted: the longest run of draft i equal to the token sampled before it
    (sampled_token_ids has one more entry than the drafts: the bonus after the last)."""
    accepted = 0
    for draft, sampled in zip(draft_token_ids, sampled_token_ids):
        if draft != sampled:
            break
        accepted += 1
    return accepted


@dataclass
class SpeculationStats:
    """Counts since this engine core started (vLLM's spec_decode counters)."""

    num_drafts: int = 0
    """Verification chunks run (one per request and step that drafted)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """accepted_per_position[i]: drafts accepted at draft position i (0 is the first)."""

    def count(self, num_drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted of drafted tokens (None before any draft)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens


class Speculator:
    """Drafts for the scheduler: one prompt-lookup drafter per request that drafted, fed its
    tokens lazily (prompt + output) when it next drafts."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.ngram = NgramConfig(max_n=config.prompt_lookup_max, min_n=config.prompt_lookup_min)
        self.drafters: dict[str, NgramDrafter] = {}
        self.stats = SpeculationStats()
        self.per_request: dict[str, list[int]] = {}
        """Live request id -> [tokens drafted for it, of those accepted] (/v1/state rows)."""
        self.lengths = (DraftLengths(config.num_speculative_tokens)
                        if config.method == "auto" else None)
        """Each request's recent acceptance, for choosing its k (auto only)."""
        self.last_step_draft_tokens = 0
        """Drafted positions verified in the latest step that decoded."""
        self._step: object = None
        """The step being scheduled (the scheduler's StepDraft), so that its price is worked
        out once and the count above restarts with it."""
        self._price: StepPrice | None = None

    def draft(self, request: Request, most: int, step: object = None,
              price: Callable[[], StepPrice] | None = None) -> list[int]:
        """Up to min(most, num_speculative_tokens) tokens to verify after request's last
        token ([] when it may not draft or nothing matches); with auto, as many of those as
        pay at the price of the step (price() is called once a step)."""
        if step is not self._step:
            self._step, self._price, self.last_step_draft_tokens = step, None, 0
        k = min(most, self.config.num_speculative_tokens)
        if k <= 0:
            return []
        if self.lengths is not None:
            if self._price is None and price is not None:
                self._price = price()
            k = self.lengths.choose(request.request_id, self._price,
                                    request.num_computed_tokens, k)
            if k == 0:
                return []
        drafter = self.drafters.get(request.request_id)
        if drafter is None or len(drafter.tokens) > request.num_tokens:
            drafter = self.drafters[request.request_id] = NgramDrafter(config=self.ngram)
        drafter.extend(request.token_slice(len(drafter.tokens), request.num_tokens))
        return drafter.draft(k)

    def verified(self, request_id: str, draft_token_ids: list[int],
                 sampled_token_ids: list[int]) -> int:
        """How many of request_id's drafts the model accepted (counted in stats)."""
        accepted = num_accepted(draft_token_ids, sampled_token_ids)
        self.stats.count(len(draft_token_ids), accepted)
        counts = self.per_request.setdefault(request_id, [0, 0])
        counts[0] += len(draft_token_ids)
        counts[1] += accepted
        self.last_step_draft_tokens += len(draft_token_ids)
        if self.lengths is not None:
            self.lengths.observe(request_id, len(draft_token_ids), accepted)
        return accepted

    def forget(self, request_id: str) -> None:
        self.drafters.pop(request_id, None)
        self.per_request.pop(request_id, None)
        if self.lengths is not None:
            self.lengths.forget(request_id)

    def request_counts(self, request_id: str) -> dict:
        """A request's row in /v1/state: tokens drafted for it and accepted."""
        drafted, accepted = self.per_request.get(request_id, (0, 0))
        return {"draft_tokens": drafted, "accepted_tokens": accepted}

    def snapshot(self) -> dict:
        """What /v1/state shows (and /metrics counts)."""
        stats = self.stats
        return {"method": self.config.method,
                "num_speculative_tokens": self.config.num_speculative_tokens,
                "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                "num_accepted_tokens": stats.num_accepted_tokens,
                "accepted_per_position": list(stats.accepted_per_position),
                "acceptance_rate": stats.acceptance_rate,
                "last_step_draft_tokens": self.last_step_draft_tokens}
