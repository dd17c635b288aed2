"""A scheduled step: each request's share of it (ScheduledWork), the whole step
(SchedulerOutput), what the workers receive of it (SchedulerOutput.plan) and what the step cost
model sees of it (step_shape). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
from tokstream.engine.request import Request
from tokstream.engine.scheduler.step_cost import StepShape, attended_tokens


@dataclass
class ScheduledWork:
    """One request's share of a step."""

    request: Request
    start: int
    """First position computed this step (== request.num_computed_tokens before the step)."""
    num_tokens: int
    new_block_ids: list[int]
    is_new: bool
    """The worker has not seen this request (first admission or re-admission after preemption)."""
    samples: bool = False
    """This chunk reaches the end of the request's tokens, so a token is sampled after it."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: guesses of the tokens after the request's last one, computed
    after it in this chunk (num_tokens counts them) and verified by a token sampled after
    each position (speculation.py)."""
    kept_blocks: int | None = None
    """Blocks of the request's table the workers keep before appending new_block_ids (a
    speculative step's rejected positions gave the rest back); None: all of them."""

    def __post_init__(self):
        self.samples = (self.start + self.num_tokens - len(self.draft_token_ids)
                        == self.request.num_tokens)

    @property
    def is_decode(self) -> bool:
        """One token computed and one sampled: the one rule for a decode, everywhere (the
        worker's chunk says the same: ScheduledChunk.is_decode)."""
        return self.num_tokens == 1 and self.samples

    @property
    def is_verify(self) -> bool:
        """A decode with drafts: its last token and the drafts computed, one token sampled
        after each."""
        return bool(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    work: list[ScheduledWork] = field(default_factory=list)
    """Decodes (one token) first, then prefill chunks."""
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    """Requests ended while scheduling (too big for the whole pool)."""
    forgotten_ids: list[str] = field(default_factory=list)
    """Requests the workers should drop: finished, aborted or preempted since the last step."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(pool block, host block) copies for requests swapped out in this step."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, pool block) copies for swapped requests re-admitted in this step."""

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.work)

    @property
    def num_decodes(self) -> int:
        return sum(1 for w in self.work if w.is_decode)

    @property
    def num_verify_tokens(self) -> int:
        """Tokens of decodes with drafts (speculative decoding): last tokens and drafts."""
        return sum(w.num_tokens for w in self.work if w.is_verify)

    def plan(self, step_id: int) -> StepPlan:
        """What the workers receive for this step: the same work, projected onto the
        messages a worker reads (a request new to them brings its sampling settings)."""
        plan = StepPlan(step_id, finished_ids=self.forgotten_ids, swap_out=self.swap_out,
                        swap_in=self.swap_in)
        for work in self.work:
            request = work.request
            if work.is_new:
                plan.new_requests.append(new_request_data(request, work.start))
            end = work.start + work.num_tokens - len(work.draft_token_ids)
            scores = request.scores_prompt and end < len(request.prompt_token_ids)
            plan.chunks.append(ScheduledChunk(
                request.request_id, request.token_slice(work.start, end) + work.draft_token_ids,
                work.start, work.new_block_ids,
                request.num_output_tokens if work.samples else None,
                request.prompt_token_ids[end] if scores else None,
                num_draft_tokens=len(work.draft_token_ids), kept_blocks=work.kept_blocks))
        return plan


def step_shape(work: list[ScheduledWork]) -> StepShape:
    """A step's work as the cost model sees it. A verify chunk's positions are decode rows:
    the ranks run them as such, in the one-call decode stack (model_runner.prepare); counted as
    prompt tokens they made a step of decodes and verifications look like one carrying prefill,
    and taught the fit prefill costs from decode-stack times."""
    decodes = sum(w.num_tokens for w in work if w.is_decode or w.is_verify)
    return StepShape(decodes, sum(w.num_tokens for w in work) - decodes,
                     sum(attended_tokens(w.start, w.num_tokens) for w in work))


def new_request_data(request: Request, start: int) -> NewRequestData:
    """A request's sampling settings for the workers, at its (re-)admission from start."""
    p = request.params
    return NewRequestData(
        request.request_id, p, request.seed, num_prompt_tokens=len(request.prompt_token_ids),
        scores_prompt=request.scores_prompt,
        history=request.token_slice(0, start) if p.needs_history else [])
