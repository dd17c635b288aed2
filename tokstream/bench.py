"""Offline throughput and latency of the engine alone (`tokstream bench`). No HTTP, no torch
in this process: it drives an in-process engine core whose worker runs the model."""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

from tokstream.config import BenchSpec, EngineConfig, SchedulerConfig
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams
from tokstream.stats import percentiles


@dataclass
class _Timing:
    submitted: float
    token_times: list[float] = field(default_factory=list)


def random_prompts(spec: BenchSpec, vocab_size: int, special_ids: set[int]) -> list[list[int]]:
    rng = random.Random(spec.seed)
    low = min(100, vocab_size // 4)  # skip the special tokens at the bottom of most vocabularies
    prompts = []
    for _ in range(spec.num_requests):
        prompt = []
        while len(prompt) < spec.input_len:
            token = rng.randrange(low, vocab_size)
            if token not in special_ids:
                prompt.append(token)
        prompts.append(prompt)
    return prompts


def run_bench(llm: LLM, spec: BenchSpec, on_token=None) -> dict:
    core = llm.core
    special = set(core.model_config.eos_token_ids) | set(llm.tokenizer.eos_token_ids)
    prompts = random_prompts(spec, core.model_config.vocab_size, special)
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    pending = [EngineRequest(f"bench-{i}", p, params) for i, p in enumerate(prompts)]
    pending.reverse()
    timings: dict[str, _Timing] = {}
    step_times: list[float] = []
    step_batch: list[int] = []
    in_flight = 0
    started = time.perf_counter()
    while pending or core.has_work:
        while pending and in_flight < spec.concurrency:
            request = pending.pop()
            core.add_request(request)
            timings[request.request_id] = _Timing(time.perf_counter())
            in_flight += 1
        deltas = core.step()
        now = time.perf_counter()
        if core.last_step is not None:
            step_times.append(core.last_step.step_s)
            step_batch.append(core.last_step.num_seqs)
        for delta in deltas:
            timings[delta.request_id].token_times.extend([now] * len(delta.token_ids))
            if on_token is not None:
                on_token(len(delta.token_ids))
            if delta.finished:
                in_flight -= 1
    elapsed = time.perf_counter() - started
    return summarize(spec, llm, timings, step_times, step_batch, elapsed)


def summarize(spec, llm, timings, step_times, step_batch, elapsed) -> dict:
    output_tokens = sum(len(t.token_times) for t in timings.values())
    ttft = [t.token_times[0] - t.submitted for t in timings.values() if t.token_times]
    itl = [b - a for t in timings.values() for a, b in zip(t.token_times, t.token_times[1:])]
    # Steps where every running sequence decodes one token: the steady-state decode step.
    full = max(step_batch) if step_batch else 0
    decode_steps = [s for s, b in zip(step_times, step_batch) if b == full]
    return {
        "model": llm.core.model_config.name,
        "dtype": llm.core.dtype,
        "device": llm.config.device,
        "tp": llm.config.tp,
        "num_requests": spec.num_requests,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "concurrency": spec.concurrency,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + spec.num_requests * spec.input_len) / elapsed,
        "num_steps": len(step_times),
        "step_ms": {k: (v * 1000 if v is not None else None)
                    for k, v in percentiles(step_times).items()},
        "decode_step_ms_at_max_batch": {k: (v * 1000 if v is not None else None)
                                        for k, v in percentiles(decode_steps).items()},
        "max_batch": full,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "preemptions": llm.core.scheduler.num_preemptions,
    }


def bench_config(model: str, dtype: str, device: str, spec: BenchSpec, **kwargs) -> EngineConfig:
    return fit_concurrency(EngineConfig(model=model, dtype=dtype, device=device, **kwargs), spec)


def fit_concurrency(config: EngineConfig, spec: BenchSpec) -> EngineConfig:
    """Enough room for every sequence at once: the benchmark measures batching, not the pool."""
    config.scheduler.max_num_seqs = max(config.scheduler.max_num_seqs, spec.concurrency)
    return config


SWEEP_PARAMS = {"max-num-seqs": "max_num_seqs", "token-budget": "max_num_batched_tokens"}
"""The dials `tokstream bench --sweep` can turn: CLI name -> SchedulerConfig field."""


def run_sweep(llm: LLM, spec: BenchSpec, param: str, values: list[int], on_point=None) -> dict:
    """The throughput-latency dial: the same workload once per value of one scheduler knob, on
    one engine (the knob is read afresh every step). Each point draws its own prompts, so no
    point finds another's prefix in the cache."""
    field_name = SWEEP_PARAMS[param]
    live = llm.core.config.scheduler
    run_bench(llm, BenchSpec(num_requests=2, input_len=16, output_len=4, seed=spec.seed - 1))
    points = []
    for index, value in enumerate(values):
        SchedulerConfig(**{**dataclasses.asdict(live), field_name: value})  # validate
        setattr(live, field_name, value)
        result = run_bench(llm, dataclasses.replace(spec, seed=spec.seed + index))
        point = {"value": value, **{key: result[key] for key in (
            "output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "ttft_s", "itl_s",
            "max_batch", "preemptions")}}
        points.append(point)
        if on_point is not None:
            on_point(point)
    first = points[0] if points else {}
    return {"sweep": param, "values": list(values), "model": llm.core.model_config.name,
            "dtype": llm.core.dtype, "device": llm.config.device,
            "num_requests": spec.num_requests, "input_len": spec.input_len,
            "output_len": spec.output_len, "concurrency": spec.concurrency,
            "max_num_seqs": live.max_num_seqs if param != "max-num-seqs" else None,
            "token_budget": live.max_num_batched_tokens if param != "token-budget" else None,
            "points": points, "first_point_elapsed_s": first.get("elapsed_s")}


def plot_sweep(sweep: dict, path: str) -> None:
    """Output tokens/s against ITL (p50, p99) and TTFT (p50, p99), one marker per value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sweep["points"]
    x = [p["output_tokens_per_s"] for p in points]
    fig, (itl_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, scale, unit in ((itl_ax, "itl_s", 1000, "ms"), (ttft_ax, "ttft_s", 1, "s")):
        for quantile, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [p[key][quantile] * scale for p in points], style,
                    label=f"{key.split('_')[0].upper()} {quantile}")
        for p, xi in zip(points, x):
            ax.annotate(str(p["value"]), (xi, p[key]["p99"] * scale),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{key.split('_')[0].upper()} ({unit}, log scale)")
        ax.set_yscale("log")  # a prefill stall puts p99 an order of magnitude above p50
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{sweep['model']} {sweep['dtype']} {sweep['device']}: sweep over "
                 f"{sweep['sweep']} (labels), {sweep['num_requests']} requests "
                 f"{sweep['input_len']}->{sweep['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
