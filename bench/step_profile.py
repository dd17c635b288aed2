"""Where a decode step's time goes: one rank's ModelRunner.execute on the real model, in this
process (no IPC), split into linear layers, attention, norms/rotary/KV writes, the LM head,
sampling and the rest (Python, tensor bookkeeping), and the same step's linear layers timed
alone on the same shapes, a run of them after each served step. Then the offline engine (core
+ worker process) at the same batch, whose step time minus the runner's is the core's
scheduling and IPC share.

    .venv/bin/python bench/step_profile.py --batch 32 --context 192 --weights native
    .venv/bin/python bench/step_profile.py --batch 1 --weights native --weights float32
    .venv/bin/python bench/step_profile.py --prefill --batch 16 --context 128 --weights native

Writes bench/results/step_profile-<cpu kind>.json (one entry per --weights and --batch; the
kind as tokstream.kernels.cpu_build.cpu_kind names it, so another CPU's results stay), with
the CPU model, its kernel-relevant flags and the load average before each measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from worker_env import as_a_rank  # noqa: E402

if __name__ == "__main__":
    as_a_rank()  # the served runner's malloc and huge pages, before torch allocates

import torch  # noqa: E402

FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                     "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")


def machine() -> dict:
    from tokstream.kernels import cpu_build

    flags = cpu_build.cpu_flags()
    return {"cpu_model": cpu_build.cpu_model(), "cores": os.cpu_count(),
            "cpu_flags": [f for f in FLAGS_OF_INTEREST if f in flags],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "worker_env": {k: os.environ.get(k) for k in ("THP_MEM_ALLOC_ENABLE",
                                                          "MALLOC_MMAP_THRESHOLD_")}}


class Timers:
    """Wall time per component, summed over calls; wrap() times a callable."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.enabled = False

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - started
            return out
        return timed


def build_runner(weights: str, num_blocks: int, block_size: int, kv_cache_dtype: str):
    from tokstream.config import EngineConfig
    from tokstream.model.source import resolve_model
    from tokstream.model.weights import load_native_state_dict, load_state_dict
    from tokstream.worker.backend import TorchBackend
    from tokstream.worker.dtype_choice import (bfloat16_copies_wanted, copy_budget,
                                               resolve_kv_cache_dtype, resolve_weights)
    from tokstream.worker.model import LlamaModel
    from tokstream.worker.model_runner import TORCH_DTYPES, ModelRunner, allocate_kv_caches
    from tokstream.worker.path_choice import measure_crossovers

    config = EngineConfig(model="smollm2", weights=weights)
    source = resolve_model(config.model)
    budget = copy_budget(config)
    fmt, dtype = resolve_weights(config.weights, config.dtype, source, "cpu", budget)
    torch_dtype = TORCH_DTYPES[dtype]
    model = LlamaModel(source.config, torch_dtype, backend=TorchBackend())
    model.load_weights(load_native_state_dict(source) if fmt == "native"
                       else load_state_dict(source, torch_dtype))
    model.pack_weights_for_cpu()
    if model.quantized_weights():
        measure_crossovers(model.quantized_weights(), budget,
                           model.decoder_weights() if bfloat16_copies_wanted(
                               config, fmt, "cpu") else [])
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, "cpu")
    caches = allocate_kv_caches(source.config, num_blocks, block_size, 1,
                                TORCH_DTYPES[kv_dtype], torch.device("cpu"))
    return ModelRunner(model, caches, block_size, torch.device("cpu")), fmt, dtype, kv_dtype


def instrument(runner, timers: Timers) -> None:
    """Route every component through a timer (the model's own functions, unchanged)."""
    import tokstream.worker.model_runner as model_runner

    model = runner.model
    for layer in model.layers:
        layer.linear = timers.wrap("linear", layer.linear)
        # the gate/up product with its SiLU, where bf16dot takes it: a linear, SiLU included
        layer.silu_product = timers.wrap("linear", layer.silu_product)
    model.head_linear = timers.wrap("lm_head", model.head_linear)
    backend = model.backend
    for name, part in (("add_rms_norm", "norms"), ("rotate", "rotary"),
                       ("write_kv", "kv_write"), ("attention", "attention")):
        setattr(backend, name, timers.wrap(part, getattr(type(backend), name)))
    model._embed = timers.wrap("embedding", model._embed)
    runner.prepare = timers.wrap("prepare_inputs", runner.prepare)
    model_runner.sample = timers.wrap("sampling", model_runner.sample)


def decode_plans(batch: int, context: int, block_size: int, steps: int):
    """A prefill plan that fills `batch` sequences to `context` tokens, then decode plans."""
    from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
    from tokstream.sampling_params import SamplingParams

    blocks_per_seq = -(-(context + steps + 1) // block_size)
    generator = torch.Generator().manual_seed(0)
    ids = [f"r{i}" for i in range(batch)]
    greedy = SamplingParams(temperature=0.0)
    prefill = StepPlan(0, [NewRequestData(r, greedy, i) for i, r in enumerate(ids)], [
        ScheduledChunk(r, torch.randint(10, 40000, (context,), generator=generator).tolist(), 0,
                       list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0)
        for i, r in enumerate(ids)])
    decodes = [StepPlan(1 + s, [], [ScheduledChunk(r, [100 + s], context + s, [], 1 + s)
                                    for r in ids]) for s in range(steps)]
    return prefill, decodes, batch * blocks_per_seq


def linears_alone(runner, batch: int):
    """A callable running one step's linear layers (every layer's four, plus the head) on
    random inputs of the step's shapes: what the step would cost if nothing else ran."""
    model = runner.model
    hidden = model.config.hidden_size
    x = torch.randn(batch, hidden)
    inter = model.layers[0].down.shape[1]
    q = model.layers[0].o_proj.shape[1]
    mid = torch.randn(batch, inter)
    att = torch.randn(batch, q)
    dtype = model.dtype
    x, mid, att = x.to(dtype), mid.to(dtype), att.to(dtype)

    def run():
        for layer in model.layers:
            layer.linear(x, layer.qkv, layer.qkv_bias)
            layer.linear(att, layer.o_proj)
            layer.linear(x, layer.gate_up)
            layer.linear(mid, layer.down)
        model.head_linear(x, model.lm_head)

    run()
    return run


def seconds(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def timed_steps(runner, plans) -> list[float]:
    return [seconds(runner.execute, plan) for plan in plans]


def profile(weights: str, batch: int, context: int, steps: int,
            kv_cache_dtype: str = "auto") -> dict:
    """The step as served (the one-call decode stack where it applies), then the same step on
    the per-layer path with every part timed: the stack has no Python between its parts to
    time, so the parts are the per-layer path's."""
    block_size = 16
    load_before = os.getloadavg()[0]
    prefill, decodes, num_blocks = decode_plans(batch, context, block_size, 2 * steps + 3)
    runner, fmt, dtype, kv_dtype = build_runner(weights, num_blocks, block_size,
                                                kv_cache_dtype)
    timers = Timers()
    instrument(runner, timers)
    runner.execute(prefill)
    for plan in decodes[:3]:  # warm-up
        runner.execute(plan)
    # Each served step, then the linears alone once: this VM's speed drifts over seconds, and
    # a ratio of two medians taken minutes apart measured the drift as much as the step.
    linears = linears_alone(runner, batch)
    served, alone = [], []
    for plan in decodes[3:3 + steps]:
        served.append(seconds(runner.execute, plan))
        alone.append(seconds(linears))
    fused = runner.model.fused_decode
    runner.model.fused_decode = False
    timers.enabled = True
    per_layer = timed_steps(runner, decodes[3 + steps:])
    timers.enabled = False
    runner.model.fused_decode = fused
    total = sum(per_layer)
    parts = {name: seconds / steps * 1e3 for name, seconds in timers.seconds.items()}
    parts["other_python"] = total / steps * 1e3 - sum(parts.values())
    alone = statistics.median(alone) * 1e3
    step_ms = statistics.median(served) * 1e3
    return {"weights": weights, "format": fmt, "dtype": dtype, "kv_cache_dtype": kv_dtype,
            "batch": batch,
            "context": context, "steps": steps, "load_average_before": load_before,
            "step_ms_median": round(step_ms, 3),
            "step_ms_mean": round(sum(served) / steps * 1e3, 3),
            "decode_stack": bool(fused and fmt == "native"),
            "per_layer_step_ms_median": round(statistics.median(per_layer) * 1e3, 3),
            "per_layer_parts_ms_mean": {k: round(v, 3) for k, v in sorted(parts.items())},
            "linear_alone_ms": round(alone, 3),
            "step_over_linear_alone": round(step_ms / alone, 3),
            "output_tokens_per_s": round(batch / (step_ms / 1e3), 1)}


def profile_prefill(weights: str, batch: int, context: int, steps: int,
                    kv_cache_dtype: str = "auto") -> dict:
    """A prefill step of `batch` new prompts of `context` tokens each (what a burst of
    requests arriving together costs), with every part timed: the same plan run again each
    time, after one untimed run."""
    block_size = 16
    load_before = os.getloadavg()[0]
    prefill, _, num_blocks = decode_plans(batch, context, block_size, 0)
    runner, fmt, dtype, kv_dtype = build_runner(weights, num_blocks, block_size,
                                                kv_cache_dtype)
    timers = Timers()
    instrument(runner, timers)
    runner.execute(prefill)
    timers.enabled = True
    timed = timed_steps(runner, [prefill] * steps)
    parts = {name: seconds / steps * 1e3 for name, seconds in timers.seconds.items()}
    parts["other_python"] = sum(timed) / steps * 1e3 - sum(parts.values())
    step_ms = statistics.median(timed) * 1e3
    return {"weights": weights, "format": fmt, "dtype": dtype, "kv_cache_dtype": kv_dtype,
            "prefill": {"prompts": batch, "tokens_each": context}, "steps": steps,
            "load_average_before": load_before, "step_ms_median": round(step_ms, 3),
            "parts_ms_mean": {k: round(v, 3) for k, v in sorted(parts.items())},
            "ms_per_prompt_token": round(step_ms / (batch * context), 4)}


def engine_step(weights: str, batch: int, context: int, output_len: int) -> dict:
    """The offline engine's step at the same batch (scheduler + pipe + worker process)."""
    from tokstream.bench import BenchSpec, bench_config, run_bench
    from tokstream.engine.llm import LLM

    spec = BenchSpec(batch, context, output_len, batch, 0)
    config = bench_config("smollm2", "auto", "cpu", spec, weights=weights)
    load_before = os.getloadavg()[0]
    with LLM(config) as llm:
        run_bench(llm, BenchSpec(2, 16, 4, 2, 1))
        result = run_bench(llm, spec)
    return {"load_average_before": load_before, "step_ms": result["step_ms"],
            "output_tokens_per_s": result["output_tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", action="append", help="native, float32, bfloat16, auto "
                        "(repeatable; default native and float32)")
    parser.add_argument("--batch", type=int, action="append", help="repeatable (default 1, 32)")
    parser.add_argument("--kv-cache-dtype", action="append", help="auto, float32, float16 "
                        "(repeatable; default auto)")
    parser.add_argument("--context", type=int, default=192, help="tokens already cached")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--engine", action="store_true", help="also time the offline engine")
    parser.add_argument("--prefill", action="store_true",
                        help="profile a prefill step instead: --batch prompts of --context "
                             "tokens each, all new (e.g. --batch 16 --context 128, a 2,048-token "
                             "step of a burst)")
    parser.add_argument("--out", default=None, help="default bench/results/"
                        "step_profile-<cpu kind>.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(os.cpu_count() or 1)
    runs = []
    for weights in args.weights or ["native", "float32"]:
        for kv_dtype in args.kv_cache_dtype or ["auto"]:
            for batch in args.batch or [1, 32]:
                with torch.inference_mode():
                    run = (profile_prefill if args.prefill else profile)(
                        weights, batch, args.context, args.steps, kv_dtype)
                if args.engine:
                    run["engine"] = engine_step(weights, batch, args.context, 64)
                print(json.dumps(run), flush=True)
                runs.append(run)
    result = {"machine": machine(), "command": " ".join(sys.argv), "runs": runs}
    from tokstream.kernels import cpu_build

    out = Path(args.out or ROOT / "bench" / "results" / f"step_profile-{cpu_build.cpu_kind()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
