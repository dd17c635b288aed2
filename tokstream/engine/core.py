"""The engine core: scheduler + block manager + executor, one step at a time. No torch.

    step = schedule -> execute -> update -> emit
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass

from tokstream import envs
from tokstream.config import EngineConfig
from tokstream.detokenizer import IncrementalDetokenizer
from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.executor import Executor
from tokstream.engine.messages import (EngineRequest, NewRequestData, RequestDelta,
                                       ScheduledChunk, ScoreRequest, ScoreResult, StepPlan,
                                       StepResult, TokenLogprobs, poison_message,
                                       token_digest)
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler import Scheduler, SchedulerOutput
from tokstream.sampling_params import SamplingParams
from tokstream.errors import OverloadedError, PromptTooLongError, ReplicaError, UserInputError
from tokstream.model.source import resolve_model
from tokstream.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("tokstream.engine")

DOWN_RETRY_S = 10.0
"""While down, seconds between attempts to start a rank group again."""
MAX_EVENTS = 64
"""Recent engine events (preemptions, capacity finishes) kept for state snapshots."""
REF_COUNT_CHARS = "0123456789"


@dataclass
class StepStats:
    num_tokens: int
    num_seqs: int
    step_s: float


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 run_dir: str | None = None):
        self.config = config
        source = resolve_model(config.model)
        self.model_config = source.config
        self.tokenizer = tokenizer or load_tokenizer(source)
        self.model_config.check_tp(config.tp)
        self.executor = Executor(config, run_dir)
        ready = self.executor.ready
        self.dtype = ready.dtype
        self.weights = ready.weights
        """'native' (GGUF blocks) or 'dequantized' (weights in dtype)."""
        self.block_manager = BlockManager(ready.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.max_model_len = self.model_config.max_position
        eos = tuple(self.model_config.eos_token_ids) or tuple(self.tokenizer.eos_token_ids)
        self.swap_space = (SwapSpace(ready.num_swap_blocks)
                           if config.cache.preemption_mode == "swap" else None)
        # On its last chance, a request runs in a step with no other such request.
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, eos,
                                   swap_space=self.swap_space,
                                   suspect_after_failures=max(1, config.max_request_failures - 1))
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.cached_tokens: dict[str, int] = {}
        """Prompt tokens each request found in the prefix cache when first scheduled."""
        self.step_id = 0
        self.prefill_tokens_total = 0
        """Tokens computed in prefill chunks (prompts, and prompt + output again after a
        preemption or restart) since this core started."""
        self.decode_tokens_total = 0
        """Tokens computed one per running stream per step since this core started."""
        self.last_step: StepStats | None = None
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._rng = random.Random()
        self.status = "ready"
        """ready | recovering | down (see recover())."""
        self._resuming: set[str] = set()
        """Requests put back in line by the last rank-group restart that have not produced a
        token since; the snapshot shows them as recovering."""
        self.on_status = None
        """Called with (status, reason) whenever the status changes (the core process
        forwards it to the gateway)."""
        self.restarts = 0
        self.resumed_requests = 0
        self.pending_deltas: list[RequestDelta] = []
        """Deltas produced outside step() (a recovery during a score pass), sent with the next
        step's."""
        self.recovery_seconds: list[float] = []
        self._next_retry = 0.0
        self.self_check_failures = 0
        """Self-checks of the block bookkeeping that found something (see self_check)."""
        self._check_every_step = envs.SELF_CHECK.is_set()
        log.info("%s", self.capacity_summary())

    def capacity_summary(self) -> str:
        """The seed's arithmetic for the live config, one line."""
        ready, tp = self.executor.ready, self.config.tp
        per_token = ready.block_bytes * tp // self.block_manager.block_size
        tokens = self.block_manager.num_blocks * self.block_manager.block_size
        return (f"model {self.model_config.name} {self.dtype} tp={tp}: "
                f"weights {ready.weight_bytes * tp / 1e9:.3f} GB {self.weights}, "
                f"KV pool {ready.num_blocks * ready.block_bytes * tp / 1e9:.3f} GB "
                f"({ready.num_blocks} blocks x {self.block_manager.block_size} tokens), "
                f"KV {ready.kv_cache_dtype or self.dtype} {per_token} B/token, "
                f"{tokens} tokens fit, "
                f"{tokens // 2000} concurrent requests at 2,000 tokens")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, submitted: EngineRequest) -> None:
        prompt, outputs = submitted.prompt_token_ids, submitted.output_token_ids
        if not prompt:
            raise UserInputError("prompt is empty")
        if submitted.request_id in self.scheduler.requests:
            raise UserInputError(f"duplicate request id {submitted.request_id!r}")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise UserInputError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + len(outputs) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {len(prompt) + len(outputs)} tokens; the model's context is "
                f"{self.max_model_len} tokens, leaving no room for output")
        if self.status == "down":
            raise OverloadedError("replica is down; retry later")
        if not submitted.weight > 0:
            raise UserInputError(f"tenant weight must be > 0, got {submitted.weight}")
        params = submitted.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(submitted.request_id, list(prompt), params, seed,
                          submitted.submitted_at, output_token_ids=list(outputs),
                          cache_salt=submitted.cache_salt,
                          tenant=submitted.tenant, priority=submitted.priority,
                          weight=submitted.weight, num_failures=submitted.num_failures,
                          prompt_group=submitted.prompt_group)
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, stop=params.stop, skip_special_tokens=params.skip_special_tokens,
            prompt_ids=prompt, delivered_ids=list(outputs))
        self.scheduler.add_request(request)

    def recover(self, reason: str) -> list[RequestDelta]:
        """The rank group failed (a rank died, hung or broke a collective): tear it down, start
        another (the warm spare if there is one), and put every live request back in line to
        be re-prefilled from prompt + the tokens it already has. Streams continue at their
        next index; sampling is a function of (seed, position), so nothing changes but time.
        After max_recovery_attempts failures in a row the replica is down: every live request
        ends with an error delta (returned) and new ones are refused until retry_when_down()
        brings a group back."""
        started = time.monotonic()
        self._set_status("recovering", reason)
        self._event("rank_failure", "", reason=reason, pids=self.executor.pids)
        self.scheduler.requeue_all()  # the pool's contents died with the ranks
        self._resuming = set(self.scheduler.requests)
        for attempt in range(1, self.config.max_recovery_attempts + 1):
            try:
                self.executor.restart()
            except ReplicaError as exc:
                self._event("restart_failed", "", reason=str(exc), attempt=attempt)
                reason = str(exc)
                continue
            self.restarts += 1
            self.resumed_requests += len(self.scheduler.requests)
            seconds = time.monotonic() - started
            self.recovery_seconds.append(seconds)
            self._event("restarted", "", seconds=round(seconds, 3), pids=self.executor.pids,
                        resumed=len(self.scheduler.requests))
            self._set_status("ready", None)
            self.self_check("recovery")
            return []
        return self._go_down(reason)

    def self_check(self, after: str, rehash: bool = True) -> list[str]:
        """Check the block bookkeeping (Scheduler.check); a finding is logged, counted and
        kept as an event: a request may be reading another's KV."""
        problems = self.scheduler.check(rehash)
        if problems:
            self.self_check_failures += 1
            log.error("block bookkeeping broken after %s: %s", after, "; ".join(problems[:5]))
            self._event("self_check_failed", "", after=after, problems=problems[:20])
        return problems

    def _fail_in_flight(self, scheduled: SchedulerOutput, reason: str) -> list[RequestDelta]:
        """The step failed: each request in it failed once more in a row. One that has failed
        max_request_failures times in a row is ended with an error, so a request that breaks
        the ranks every time cannot keep the replica restarting."""
        limit = self.config.max_request_failures
        deltas = []
        for work in scheduled.work:
            request = work.request
            if request.status.is_finished:
                continue
            request.num_failures += 1
            if request.num_failures < limit:
                continue
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.detokenizers.pop(request.request_id, None)
            self.cached_tokens.pop(request.request_id, None)
            self._event("request_failed", request.request_id, failures=request.num_failures,
                        reason=reason)
            deltas.append(RequestDelta(
                request.request_id, [], request.num_output_tokens, "", finish_reason="error",
                error=poison_message(limit, reason),
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=request.num_output_tokens))
        return deltas

    def _go_down(self, reason: str) -> list[RequestDelta]:
        self._set_status("down", reason)
        self._next_retry = time.monotonic() + DOWN_RETRY_S
        deltas = []
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.detokenizers.pop(request.request_id, None)
            self.cached_tokens.pop(request.request_id, None)
            deltas.append(RequestDelta(request.request_id, [], request.num_output_tokens, "",
                                       finish_reason="error", error=f"replica down: {reason}",
                                       num_prompt_tokens=len(request.prompt_token_ids),
                                       num_output_tokens=request.num_output_tokens))
        return deltas

    def retry_when_down(self) -> None:
        """While down, try a fresh rank group now and then; back to ready when one starts."""
        if self.status != "down" or time.monotonic() < self._next_retry:
            return
        try:
            self.executor.restart()
        except ReplicaError as exc:
            self._next_retry = time.monotonic() + DOWN_RETRY_S
            self._event("restart_failed", "", reason=str(exc), attempt=0)
            return
        self.restarts += 1
        self._event("restarted", "", seconds=None, pids=self.executor.pids, resumed=0)
        self._set_status("ready", None)

    def _set_status(self, status: str, reason: str | None) -> None:
        self.status = status
        if self.on_status is not None:
            self.on_status(status, reason)

    def abort(self, request_id: str) -> RequestDelta | None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self._final_delta(request, "")

    def step(self) -> list[RequestDelta]:
        started = time.perf_counter()
        deltas, self.pending_deltas = self.pending_deltas, []
        if self.status == "down":
            self.retry_when_down()
            return deltas
        self._resuming.intersection_update(self.scheduler.requests)
        if not self._resuming:
            self.executor.reload_spare()  # only now: its loading would slow their re-prefill
        scheduled = self.scheduler.schedule()
        deltas += [self._final_delta(r, "") for r in scheduled.finished]
        if not scheduled.work and not scheduled.forgotten_ids:
            return deltas
        for request in scheduled.preempted:
            self._event("preempted", request.request_id)
        for request in scheduled.finished:
            self._event("finished", request.request_id, reason=request.stop_reason)
        try:
            result = self.executor.execute(self._plan(scheduled))
        except ReplicaError as exc:
            return deltas + self._fail_in_flight(scheduled, str(exc)) + self.recover(str(exc))
        advanced = self.scheduler.update(scheduled, result.sampled_token_ids)
        # A failure streak ends at a token, as the gateway counts core deaths: a prefill chunk
        # that ran proves nothing, and a resumed request keeps its last-chance isolation (no
        # other suspect in its steps) until it has produced one.
        for request in advanced:
            request.num_failures = 0
        logprobs = _logprobs_by_request(scheduled, result)
        deltas += [self._emit(request, logprobs.get(request.request_id)) for request in advanced]
        if self._resuming:
            self._resuming.difference_update(request.request_id for request in advanced)
        decodes = sum(1 for w in scheduled.work
                      if w.num_tokens == 1 and w.start >= len(w.request.prompt_token_ids))
        self.decode_tokens_total += decodes
        self.prefill_tokens_total += scheduled.num_tokens - decodes
        self.last_step = StepStats(scheduled.num_tokens, len(scheduled.work),
                                   time.perf_counter() - started)
        self.scheduler.observe_step(scheduled, self.last_step.step_s)
        if self._check_every_step:
            self.self_check("a step", rehash=False)
        return deltas

    def _plan(self, scheduled: SchedulerOutput) -> StepPlan:
        self.step_id += 1
        plan = StepPlan(self.step_id, finished_ids=scheduled.forgotten_ids,
                        swap_out=scheduled.swap_out, swap_in=scheduled.swap_in)
        for work in scheduled.work:
            request = work.request
            if work.is_new:
                p = request.params
                plan.new_requests.append(NewRequestData(
                    request.request_id, p.temperature, p.top_p, p.top_k, request.seed,
                    min_p=p.min_p, presence_penalty=p.presence_penalty,
                    frequency_penalty=p.frequency_penalty,
                    repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias,
                    logprobs=p.logprobs, num_prompt_tokens=len(request.prompt_token_ids),
                    grammar=p.grammar,
                    history=request.token_slice(0, work.start) if p.needs_history else []))
                # What the prefix cache gave it the first time (a resumed request's own
                # blocks are not a cache hit for its caller).
                self.cached_tokens.setdefault(request.request_id, work.start)
            end = work.start + work.num_tokens
            plan.chunks.append(ScheduledChunk(
                request.request_id, request.token_slice(work.start, end), work.start,
                work.new_block_ids, request.num_output_tokens if work.samples else None))
        return plan

    def _emit(self, request: Request, logprobs: TokenLogprobs | None = None) -> RequestDelta:
        detokenizer = self.detokenizers[request.request_id]
        step = detokenizer.step(request.output_token_ids[-1:])
        text = step.text
        if step.stop is not None:
            if request.status.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = step.stop
            else:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED, step.stop)
        elif request.status.is_finished:
            text += detokenizer.finish()
        if request.status.is_finished:
            return self._final_delta(request, text, last_token=True, logprobs=logprobs)
        index = request.num_output_tokens - 1
        return RequestDelta(request.request_id, request.output_token_ids[-1:], index, text,
                            num_prompt_tokens=len(request.prompt_token_ids),
                            num_output_tokens=request.num_output_tokens, step_id=self.step_id,
                            logprobs=[logprobs] if logprobs else None,
                            num_cached_tokens=self.cached_tokens.get(request.request_id, 0))

    def _final_delta(self, request: Request, text: str, last_token: bool = False,
                     logprobs: TokenLogprobs | None = None) -> RequestDelta:
        self.detokenizers.pop(request.request_id, None)
        cached = self.cached_tokens.pop(request.request_id, 0)
        tokens = request.output_token_ids[-1:] if last_token else []
        queue_s = (request.first_scheduled - request.arrival
                   if request.first_scheduled is not None else None)
        return RequestDelta(
            request.request_id, tokens, request.num_output_tokens - len(tokens), text,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=request.num_output_tokens,
            step_id=self.step_id if last_token else 0,
            output_digest=token_digest(request.output_token_ids), queue_s=queue_s,
            logprobs=[logprobs] if logprobs and last_token else None, num_cached_tokens=cached)

    def _event(self, kind: str, request_id: str, **fields) -> None:
        self.events.append({"time": time.time(), "kind": kind, "request_id": request_id,
                            **fields})

    def score(self, token_ids: list[int], start: int = 1) -> ScoreResult:
        """Teacher-forced pass over token_ids on blocks lent from the pool: for positions
        start..n-1, the logit of the token there and the top logit, after the tokens before."""
        n = len(token_ids)
        if n < 2:
            raise UserInputError("token_ids: need at least 2 tokens to score")
        if not 1 <= start < n:
            raise UserInputError(f"start: must be in [1, {n - 1}], got {start}")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise UserInputError(f"token_ids: every id must be in [0, {vocab})")
        if n > self.max_model_len:
            raise PromptTooLongError(f"token_ids: {n} tokens exceed the model's context of "
                                     f"{self.max_model_len}")
        if self.block_manager.blocks_for(n) > self.block_manager.num_blocks:
            raise UserInputError(f"token_ids: {n} tokens do not fit in the KV pool")
        borrower = Request("score", list(token_ids), SamplingParams(max_tokens=1), 0,
                           time.monotonic())
        block_ids = self.block_manager.allocate(
            borrower, n, reserve=self.config.scheduler.watermark_blocks)
        if block_ids is None:
            raise OverloadedError(f"KV pool busy: no room to score {n} tokens now")
        try:
            return self.executor.score(ScoreRequest(list(token_ids), block_ids, start))
        except ReplicaError as exc:
            self.block_manager.free(borrower)
            self.pending_deltas += self.recover(str(exc))
            raise OverloadedError(f"scoring interrupted by a rank failure: {exc}") from exc
        finally:
            if borrower.block_ids:
                self.block_manager.free(borrower)

    def snapshot(self) -> dict:
        """Plain-data state for /v1/state: scheduler, block map, requests, events, pids."""
        now = time.monotonic()
        scheduler, blocks = self.scheduler, self.block_manager
        sched = self.config.scheduler
        requests = []
        for request in scheduler.requests.values():
            requests.append({
                "id": request.request_id, "state": request.status.name.lower(),
                "phase": self._phase(request),
                "tenant": request.tenant, "priority": request.priority,
                "prompt_tokens": len(request.prompt_token_ids),
                "output_tokens": request.num_output_tokens,
                "computed_tokens": request.num_computed_tokens,
                "blocks": len(request.block_ids), "preemptions": request.num_preemptions,
                "swapped_blocks": len(request.swapped_block_ids),
                "age_s": now - request.arrival,
                "queue_s": (request.first_scheduled - request.arrival
                            if request.first_scheduled is not None else None)})
        last = self.last_step
        return {
            "pid": os.getpid(),
            "status": self.status,
            "restarts": self.restarts,
            "resumed_requests": self.resumed_requests,
            "recovery_s": self.recovery_seconds[-1] if self.recovery_seconds else None,
            "worker_alive": self.executor.alive(),
            "worker_pids": self.executor.pids,
            "step_id": self.step_id,
            "last_step": ({"num_tokens": last.num_tokens, "num_seqs": last.num_seqs,
                           "step_ms": last.step_s * 1000} if last else None),
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "max_num_seqs": self.config.scheduler.max_num_seqs,
            "token_budget": sched.max_num_batched_tokens,
            "chunked_prefill": sched.chunked_prefill,
            # Most prompt tokens of one request per step; None: prompts go whole.
            "max_prefill_chunk": ((sched.max_prefill_chunk or sched.max_num_batched_tokens)
                                  if sched.chunked_prefill else None),
            "num_preemptions": scheduler.num_preemptions,
            "prefill_tokens_total": self.prefill_tokens_total,
            "decode_tokens_total": self.decode_tokens_total,
            "preemption_mode": self.config.cache.preemption_mode,
            "num_swap_preemptions": scheduler.num_swap_outs,
            "kv": {"block_size": blocks.block_size, "num_blocks": blocks.num_blocks,
                   "free_blocks": blocks.num_free_blocks, "used_blocks": blocks.num_used_blocks,
                   "cached_blocks": blocks.num_cached_blocks, "usage": blocks.usage,
                   "prefix_cache_queries": blocks.prefix_queries,
                   "prefix_cache_hits": blocks.prefix_hits,
                   "swap_blocks": self.swap_space.num_blocks if self.swap_space else 0,
                   "free_swap_blocks": (self.swap_space.num_free_blocks
                                        if self.swap_space else 0),
                   "block_map": self._block_map(),
                   # Problems the bookkeeping has now (none when sound), and how many
                   # self-checks since the start found any.
                   "self_check": self.scheduler.check(rehash=False),
                   "self_check_failures": self.self_check_failures},
            "requests": requests,
            "tenants": scheduler.ledger.snapshot(),
            "policy": self.config.scheduler.policy,
            "events": list(self.events),
        }

    def _phase(self, request: Request) -> str:
        """waiting | prefill | decode | preempted | recovering: where a request is in its life.
        A running request decodes once every token but the newest sampled one is in the
        cache; one re-prefilling after a rank-group restart is recovering."""
        if request.request_id in self._resuming:
            return "recovering"
        if request.status != RequestStatus.RUNNING:
            return request.status.name.lower()
        return "prefill" if request.num_computed_tokens < request.num_tokens - 1 else "decode"

    def _block_map(self) -> dict:
        """Compact per-block map: one character per block for its reference count ('0'-'9',
        '+' past 9); per owner, its block ids as [first, count] runs; and the blocks that hold
        a cached prefix (held or evictable) as runs."""
        ref_counts = "".join(REF_COUNT_CHARS[c] if c < 10 else "+"
                             for c in self.block_manager.ref_counts)
        owners = {request.request_id: _runs(request.block_ids)
                  for request in self.scheduler.running}
        return {"ref_counts": ref_counts, "owners": owners,
                "cached": self.block_manager.cached_runs}

    def shutdown(self) -> None:
        self.executor.shutdown()


def _runs(block_ids: list[int]) -> list[list[int]]:
    """Block ids as [first, count] runs of consecutive ids, in order."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return runs


def _logprobs_by_request(scheduled: SchedulerOutput,
                         result: StepResult) -> dict[str, TokenLogprobs]:
    """The step's log-probabilities by request, for the requests that asked (the worker
    returns them beside its sampled tokens, in the order of the work that samples)."""
    if not result.logprobs:
        return {}
    sampling = [work.request.request_id for work in scheduled.work if work.samples]
    return {rid: lp for rid, lp in zip(sampling, result.logprobs) if lp is not None}
