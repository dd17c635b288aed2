"""The engine core: scheduler + block manager + executor, one step at a time. No torch.

    step = schedule -> execute -> update -> emit
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque

from tokstream.config import EngineConfig
from tokstream.text.detokenizer import IncrementalDetokenizer
from tokstream.engine import core_snapshot
from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.core_snapshot import StepStats
from tokstream.engine.executor import Executor
from tokstream.engine.messages.request import EngineRequest, RequestDelta, token_digest
from tokstream.engine.messages.worker import ScoreResult, StepPlan, StepResult, TokenLogprobs
from tokstream.engine.recovery.core_recovery import CoreRecovery
from tokstream.engine.recovery.pool_files import PoolPaths
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.output import SchedulerOutput
from tokstream.engine.scheduler.scheduler import Scheduler
from tokstream.engine.scoring import Scorer
from tokstream.engine.speculation import Speculator
from tokstream.engine.step_times import StepTimes, StepTimesLog
from tokstream.errors import (ErrorKind, OverloadedError, PromptTooLongError, ReplicaError,
                              UserInputError)
from tokstream.model.source import resolve_model
from tokstream.state_snapshot import ReplicaStatus
from tokstream.text.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("tokstream.engine")

MAX_EVENTS = 64
"""Recent engine events (preemptions, capacity finishes) kept for state snapshots."""


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 run_dir: str | None = None, pool: PoolPaths | None = None):
        self.config = config
        source = resolve_model(config.model)
        self.model_config = source.config
        self.tokenizer = tokenizer or load_tokenizer(source)
        self.model_config.check_tp(config.tp)
        self.executor = Executor(config, run_dir, pool)
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
        self.speculator = (Speculator(config.speculative) if config.speculative.enabled
                           else None)
        # On its last chance, a request runs in a step with no other such request.
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, eos,
                                   swap_space=self.swap_space,
                                   suspect_after_failures=max(1, config.max_request_failures - 1),
                                   speculator=self.speculator)
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
        self.recovery = CoreRecovery(config, self.executor, self.scheduler, self.block_manager,
                                     self.event, self._forget)
        """Rank-group failures: the status, restarts, retries, pending deltas (recovery/)."""
        self.step_times = StepTimesLog.from_env()
        """Diagnostics: each step's times, to the file TOKSTREAM_STEP_TIMES names."""
        self.scorer = Scorer(self.executor, self.block_manager, self.model_config.vocab_size,
                             self.max_model_len, config.scheduler.watermark_blocks,
                             self.recovery.recover_between_steps)
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

    @property
    def status(self) -> ReplicaStatus:
        """ready | recovering | down (CoreRecovery)."""
        return self.recovery.status

    @property
    def pending_deltas(self) -> list[RequestDelta]:
        """Deltas a recovery between steps left for the next step (CoreRecovery)."""
        return self.recovery.pending_deltas

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
        if self.status == ReplicaStatus.DOWN:
            raise OverloadedError("replica is down; retry later")
        if not submitted.weight > 0:
            raise UserInputError(f"tenant weight must be > 0, got {submitted.weight}")
        params = submitted.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(submitted.request_id, list(prompt), params, seed,
                          submitted.submitted_at, output_token_ids=list(outputs),
                          cache_salt=submitted.cache_salt,
                          tenant=submitted.tenant, priority=submitted.priority,
                          background=submitted.background,
                          weight=submitted.weight, num_failures=submitted.num_failures,
                          prompt_group=submitted.prompt_group)
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, stop=params.stop, skip_special_tokens=params.skip_special_tokens,
            prompt_ids=prompt, delivered_ids=list(outputs),
            include_stop=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> RequestDelta | None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self.final_delta(request, "")

    def step(self) -> list[RequestDelta]:
        """schedule -> execute -> update -> emit; a rank-group failure recovers instead."""
        began, started = time.monotonic(), time.perf_counter()
        deltas = self.recovery.take_pending()
        if self.status == ReplicaStatus.DOWN:
            self.recovery.retry_when_down()
            return deltas
        scheduled = self._schedule()
        deltas += [self.final_delta(r, "") for r in scheduled.finished]
        if not scheduled.work and not scheduled.forgotten_ids:
            return deltas
        sent = time.perf_counter()
        try:
            result = self._execute(scheduled)
        except ReplicaError as exc:
            return deltas + self.recovery.fail_step(scheduled, str(exc))
        returned = time.perf_counter()
        deltas += self._advance(scheduled, result, started)
        if self.step_times is not None:
            self.step_times.write(StepTimes(
                self.step_id, scheduled.num_tokens, len(scheduled.work), scheduled.num_decodes,
                scheduled.num_verify_tokens, began, sent - started,
                returned - sent, result.execute_s, time.perf_counter() - returned))
        return deltas

    def _execute(self, scheduled: SchedulerOutput) -> StepResult:
        """Run the step on the ranks, with its requests in the step record while it runs."""
        with self.recovery.recording(scheduled):
            return self.executor.execute(self._plan(scheduled))

    def _schedule(self) -> SchedulerOutput:
        self.recovery.reload_spare_once_resumed()
        scheduled = self.scheduler.schedule()
        for request in scheduled.preempted:
            self.event("preempted", request.request_id)
        for request in scheduled.finished:
            self.event("finished", request.request_id, reason=request.stop_reason)
        return scheduled

    def _plan(self, scheduled: SchedulerOutput) -> StepPlan:
        self.step_id += 1
        for work in scheduled.work:
            # What the prefix cache gave it the first time (a resumed request's own blocks
            # are not a cache hit for its caller).
            if work.is_new:
                self.cached_tokens.setdefault(work.request.request_id, work.start)
                if work.request.params.grammar:  # rank 0 starts compiling it
                    work.request.grammar_learned_at = time.monotonic()
        return scheduled.plan(self.step_id)

    def _advance(self, scheduled: SchedulerOutput, result: StepResult,
                 started: float) -> list[RequestDelta]:
        """The step ran: append the sampled tokens, emit their deltas, learn its cost."""
        _keep_prompt_logprobs(self.scheduler.requests, result)
        before = {w.request.request_id: w.request.num_output_tokens
                  for w in scheduled.work if w.samples}
        unsampled = set(result.grammar_pending) | {f.request_id for f in result.grammar_failures}
        advanced = self.scheduler.update(scheduled, result.sampled_token_ids, unsampled)
        self.recovery.produced(advanced)
        logprobs = _logprobs_by_request(scheduled, result, unsampled)
        deltas = [self._emit(request, logprobs.get(request.request_id),
                             before[request.request_id]) for request in advanced]
        deltas += [self._fail_grammar(request_id, message)
                   for request_id, message in self._unusable_grammars(result).items()]
        decodes = scheduled.num_decodes + scheduled.num_verify_tokens
        self.decode_tokens_total += decodes
        self.prefill_tokens_total += scheduled.num_tokens - decodes
        self.last_step = StepStats(scheduled.num_tokens, len(scheduled.work),
                                   time.perf_counter() - started)
        self.scheduler.observe_step(scheduled, self.last_step.step_s)
        if self.recovery.check_every_step:
            self.recovery.self_check("a step", rehash=False)
        return deltas

    def score(self, token_ids: list[int], start: int = 1) -> ScoreResult:
        return self.scorer.score(token_ids, start)

    def snapshot(self) -> dict:
        return core_snapshot.snapshot(self)

    def _emit(self, request: Request, logprobs: list[TokenLogprobs] | None = None,
              first_index: int | None = None) -> RequestDelta:
        """The delta of request's tokens from output index first_index on (the step's one
        token by default; after drafts, several), with their log-probabilities if it asked
        (one per token the step sampled for it, from first_index on)."""
        if first_index is None:
            first_index = request.num_output_tokens - 1
        detokenizer = self.detokenizers[request.request_id]
        text, stop = "", None
        # One token at a time, so a stop string ends the output at the token that completes
        # it, as if the tokens after it (accepted drafts) had never been sampled.
        for kept, token in enumerate(request.output_token_ids[first_index:], 1):
            step = detokenizer.step([token])
            text += step.text
            if step.stop is not None:
                stop = step.stop
                del request.output_token_ids[first_index + kept:]
                break
        if stop is not None:
            if request.status.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop
            else:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED, stop)
        elif request.status.is_finished:
            text += detokenizer.finish()
        if logprobs:  # beside the tokens kept (a stop may have cut the step's short)
            logprobs = logprobs[:request.num_output_tokens - first_index]
        # The prompt's log-probabilities go out once, with the first token.
        prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        if request.params.prompt_logprobs is not None and request.num_output_tokens == 1:
            prompt_logprobs = prompt_logprobs or [None] * len(request.prompt_token_ids)
        if request.status.is_finished:
            delta = self.final_delta(request, text, last_token=True, logprobs=logprobs,
                                     first_index=first_index)
        else:
            delta = RequestDelta(
                request.request_id, request.output_token_ids[first_index:], first_index, text,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=request.num_output_tokens, step_id=self.step_id,
                logprobs=logprobs or None,
                num_cached_tokens=self.cached_tokens.get(request.request_id, 0))
        delta.prompt_logprobs = prompt_logprobs
        return delta

    def final_delta(self, request: Request, text: str, last_token: bool = False,
                    logprobs: list[TokenLogprobs] | None = None,
                    first_index: int | None = None) -> RequestDelta:
        """request's last delta; last_token: with its tokens from output index first_index on
        (by default its last token alone)."""
        self.detokenizers.pop(request.request_id, None)
        cached = self.cached_tokens.pop(request.request_id, 0)
        if first_index is None:
            first_index = request.num_output_tokens - 1
        tokens = request.output_token_ids[first_index:] if last_token else []
        queue_s = (request.first_scheduled - request.arrival
                   if request.first_scheduled is not None else None)
        return RequestDelta(
            request.request_id, tokens, request.num_output_tokens - len(tokens), text,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=request.num_output_tokens,
            step_id=self.step_id if last_token else 0,
            output_digest=token_digest(request.output_token_ids), queue_s=queue_s,
            logprobs=logprobs if logprobs and last_token else None, num_cached_tokens=cached)

    def _unusable_grammars(self, result: StepResult) -> dict[str, str]:
        """Why each request the step left unsampled must end (request id -> message): its
        grammar failed to compile on rank 0, or has been compiling for longer than the
        limit. The others are sampled at a later step."""
        unusable = {f.request_id: f.message for f in result.grammar_failures}
        limit, now = self.config.grammar_compile_timeout_s, time.monotonic()
        for request_id in result.grammar_pending:
            request = self.scheduler.requests.get(request_id)
            learned_at = request.grammar_learned_at if request is not None else None
            if learned_at is not None and now - learned_at >= limit:
                unusable[request_id] = (
                    f"structured output: the grammar did not compile within {limit:g} s (the "
                    "server's --grammar-compile-timeout); simplify the schema, regex or "
                    "grammar (less nesting, smaller enums, simpler patterns)")
        return {request_id: message for request_id, message in unusable.items()
                if request_id in self.scheduler.requests}

    def _fail_grammar(self, request_id: str, message: str) -> RequestDelta:
        """End a request whose grammar rank 0 cannot use: its input's fault, so an
        invalid_request error for it alone."""
        request = self.scheduler.requests[request_id]
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        self.event("request_failed", request_id, reason=message)
        return RequestDelta.failure(request_id, message, ErrorKind.INVALID_REQUEST,
                                    num_output_tokens=request.num_output_tokens,
                                    num_prompt_tokens=len(request.prompt_token_ids))

    def _forget(self, request_id: str) -> None:
        """Drop a request's output state (recovery ended it with an error delta)."""
        self.detokenizers.pop(request_id, None)
        self.cached_tokens.pop(request_id, None)

    def event(self, kind: str, request_id: str, **fields) -> None:
        self.events.append({"time": time.time(), "kind": kind, "request_id": request_id,
                            **fields})

    def shutdown(self) -> None:
        if self.step_times is not None:
            self.step_times.close()
        self.executor.shutdown()


def _keep_prompt_logprobs(requests: dict[str, Request], result: StepResult) -> None:
    """File the prompt positions the step scored under their requests, by prompt index (a
    position computed again after a preemption replaces its first value)."""
    for part in result.prompt_logprobs:
        request = requests.get(part.request_id)
        if request is None or not request.scores_prompt:
            continue
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
        end = part.first_index + len(part.logprobs)
        request.prompt_logprobs[part.first_index:end] = part.logprobs


def _logprobs_by_request(scheduled: SchedulerOutput, result: StepResult,
                         unsampled: set[str]) -> dict[str, list[TokenLogprobs]]:
    """The step's log-probabilities by request, one per token sampled for it, for the
    requests that asked (the worker returns them beside its sampled tokens, in the order of
    the work that samples: 1 + its drafts for a decode with drafts; none for unsampled)."""
    if not result.logprobs:
        return {}
    rows = iter(result.logprobs)
    by_request = {}
    for work in scheduled.work:
        if work.samples and work.request.request_id not in unsampled:
            taken = [next(rows) for _ in range(1 + len(work.draft_token_ids))]
            if taken[0] is not None:
                by_request[work.request.request_id] = taken
    return by_request
