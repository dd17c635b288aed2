"""The scheduler bench's driver: timed arrivals fed to an engine core between steps, each
request's token times as its caller saw them, and a fresh warmed engine per configuration.
No torch in this process: the engine's worker holds it."""

from __future__ import annotations

import heapq
import itertools
import os
import random
import sys
import time
from dataclasses import dataclass, field

# The benches that import this module put only bench/ on sys.path; tokstream is one folder up.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from tokstream.engine.llm import LLM  # noqa: E402
from tokstream.engine.messages.request import EngineRequest  # noqa: E402
from tokstream.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Trace:
    """One request as its caller saw it."""

    kind: str
    tenant: str
    arrival: float
    """perf_counter() of its scheduled arrival: TTFT counts any wait for a running step."""
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def itls(self) -> list[tuple[float, float]]:
        """(start, end) of each gap between consecutive tokens."""
        return list(zip(self.token_times, self.token_times[1:]))


@dataclass
class Arrival:
    at: float
    """Seconds after the run starts."""
    request: EngineRequest
    kind: str = "request"


@dataclass
class Run:
    traces: dict[str, Trace]
    elapsed: float
    start: float
    step_tokens: int = 0
    """Tokens computed over all steps (prefill and decode)."""
    steps: int = 0


def drive(core, arrivals: list[Arrival], duration: float | None = None, on_finish=None,
          on_step=None, stop=None) -> Run:
    """Add each arrival when its time comes (between steps), step while there is work, until
    everything finished, `duration` seconds passed or stop(run, now) says so; then abort the
    rest. on_finish(trace, now) may return new arrivals (closed-loop callers)."""
    order = itertools.count()
    heap = [(a.at, next(order), a) for a in arrivals]
    heapq.heapify(heap)
    start = time.perf_counter()
    run = Run({}, 0.0, start)
    while True:
        now = time.perf_counter() - start
        while heap and heap[0][0] <= now:
            arrival = heapq.heappop(heap)[2]
            request = arrival.request
            core.add_request(request)
            run.traces[request.request_id] = Trace(arrival.kind, request.tenant,
                                                   start + arrival.at,
                                                   len(request.prompt_token_ids))
        if (duration is not None and now >= duration) or (stop and stop(run, now)):
            break
        if not core.has_work:
            if not heap:
                break
            time.sleep(max(0.0, heap[0][0] - now))
            continue
        step_id = core.step_id
        deltas = core.step()
        done = time.perf_counter()
        if core.step_id != step_id:
            run.steps += 1
            run.step_tokens += core.last_step.num_tokens
            if on_step is not None:
                on_step(core, done - start)
        for delta in deltas:
            trace = run.traces[delta.request_id]
            trace.token_times += [done] * len(delta.token_ids)
            if delta.finished:
                trace.finish_reason = delta.finish_reason
                for new in (on_finish(trace, done - start) if on_finish else None) or []:
                    heapq.heappush(heap, (max(new.at, done - start), next(order), new))
    run.elapsed = time.perf_counter() - start
    for request_id in list(core.scheduler.requests):
        core.abort(request_id)
    core.step()  # the worker forgets the aborted requests
    return run


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def engine(args, **overrides) -> LLM:
    """A fresh engine with scheduler/cache overrides, warmed by one short request."""
    scheduler = {k: v for k, v in overrides.items() if k in SchedulerConfig.__dataclass_fields__}
    cache = {k: v for k, v in overrides.items() if k in CacheConfig.__dataclass_fields__}
    cache.setdefault("kv_cache_memory", args.kv_cache_memory)
    config = EngineConfig(model=args.model, dtype=args.dtype, scheduler=SchedulerConfig(
        **scheduler), cache=CacheConfig(**cache))
    llm = LLM(config)
    warm = random_tokens(random.Random(-1), 48, llm.core.model_config.vocab_size)
    llm.generate([warm], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return llm
