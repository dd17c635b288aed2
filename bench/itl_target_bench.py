"""32 requests arriving at once, the ITL target off against on, side by side on one engine.

Each variant: 32 random 128-token prompts, 128 output tokens each (ignore_eos), all submitted
at t = 0 to an in-process engine core (the real scheduler, one worker running SmolLM2 in
float32). Reported per variant: ITL and TTFT (p50/p90/p99/max), output tokens/s, step times,
and with the target on the fitted step cost. Before each variant the script waits (up to 10
minutes over the whole run) for a 1-minute load average under 0.8 and records it; `quiet`
says whether it came.

    .venv/bin/python bench/itl_target_bench.py
    .venv/bin/python bench/itl_target_bench.py --target-ms 150 --json /tmp/itl.json

Writes bench/results/itl_target_bench.json. No torch in this process.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scheduler_driver import Arrival, drive, random_tokens  # noqa: E402
from scheduler_results import write_json  # noqa: E402
from tokstream.stats import percentiles  # noqa: E402
from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from tokstream.engine.llm import LLM  # noqa: E402
from tokstream.engine.messages.request import EngineRequest
from tokstream.engine.scheduler.step_cost import StepCostModel  # noqa: E402
from tokstream.sampling_params import SamplingParams  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "itl_target_bench.json")
QUIET_LOAD = 0.8


def cpu_info() -> dict:
    model, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = value.split()
                    break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": " ".join(flags),
            "simd": [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]}


def wait_until_quiet(deadline: float) -> tuple[bool, list[float], float]:
    """Wait for a 1-min load average under QUIET_LOAD until the monotonic deadline:
    (quiet, load averages when it ran, seconds waited)."""
    started = time.monotonic()
    while os.getloadavg()[0] >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(10)
    load = list(os.getloadavg())
    return load[0] < QUIET_LOAD, load, time.monotonic() - started


def ms(stats: dict) -> dict:
    return {k: (v * 1000 if v is not None else None) for k, v in stats.items()}


def run_variant(llm: LLM, target_ms: float, args, seed: int) -> dict:
    core = llm.core
    core.config.scheduler.itl_target_ms = target_ms  # the scheduler reads it every step
    # Each variant learns its step cost from scratch (the same short warm-up first), as a
    # server that has just started would.
    core.scheduler.prefill_policy.step_cost = StepCostModel()
    warm = random_tokens(random.Random(-seed), 48, core.model_config.vocab_size)
    llm.generate([warm], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    quiet, load, waited = wait_until_quiet(args.quiet_deadline)
    rng = random.Random(seed)  # fresh prompts: no prefix-cache hits between variants
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    arrivals = [Arrival(0.0, EngineRequest(f"r{i}", random_tokens(
        rng, args.input_len, core.model_config.vocab_size), params))
        for i in range(args.num_requests)]
    steps = []

    def on_step(core, now):
        last = core.last_step
        steps.append((now, last.num_tokens, last.num_seqs, last.step_s))

    run = drive(core, arrivals, duration=args.timeout, on_step=on_step)
    traces = list(run.traces.values())
    ttft = [t.ttft for t in traces if t.ttft is not None]
    gaps = [end - begin for t in traces for begin, end in t.itls()]
    output_tokens = sum(len(t.token_times) for t in traces)
    last_token = max(t.token_times[-1] for t in traces if t.token_times) - run.start
    step_s = [s[3] for s in steps]
    model = core.scheduler.step_cost
    result = {
        "itl_target_ms": target_ms,
        "quiet": quiet, "loadavg_before": load, "waited_for_quiet_s": waited,
        "completed": sum(t.finish_reason is not None for t in traces),
        "output_tokens": output_tokens,
        "elapsed_s": last_token,
        "output_tokens_per_s": output_tokens / last_token,
        "itl_ms": {**ms(percentiles(gaps)), "max": max(gaps) * 1000},
        "ttft_s": {**percentiles(ttft), "max": max(ttft)},
        "num_steps": len(steps),
        "step_ms": {**ms(percentiles(step_s)), "max": max(step_s) * 1000},
        "largest_step_tokens": max(s[1] for s in steps),
        # [tokens, sequences, ms] of the steps while the prompts go in.
        "first_steps": [[tokens, seqs, seconds * 1000]
                        for _, tokens, seqs, seconds in steps[:args.trace_steps]],
        "loadavg_after": list(os.getloadavg()),
    }
    if target_ms:
        result["gaps_over_target"] = sum(g * 1000 > target_ms for g in gaps) / len(gaps)
        result["step_cost"] = {"intercept_ms": model.intercept_s * 1000,
                               "per_decode_ms": model.per_decode_s * 1000,
                               "per_prefill_token_ms": model.per_prefill_token_s * 1000,
                               "per_attended_token_us": model.per_attended_token_s * 1e6,
                               "prefill_step_ms": model.prefill_step_s * 1000,
                               "per_decode_with_prefill_ms": model.per_decode_with_prefill_s * 1000,
                               "observations": model.num_observations}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2")
    add("--dtype", default="float32")
    add("--weights", default="float32", help="float32: the GGUF dequantised to float32")
    add("--target-ms", type=float, default=SchedulerConfig.itl_target_ms,
        help="the 'on' variant's target (default: SchedulerConfig's)")
    add("--num-requests", type=int, default=32)
    add("--input-len", type=int, default=128)
    add("--output-len", type=int, default=128)
    add("--kv-cache-memory", type=int, default=1 << 29)
    add("--timeout", type=float, default=600.0)
    add("--quiet-wait-s", type=float, default=600.0,
        help="longest wait, over the whole run, for a 1-min load average under 0.8")
    add("--trace-steps", type=int, default=40)
    add("--json", default=RESULTS)
    args = parser.parse_args()
    args.quiet_deadline = time.monotonic() + args.quiet_wait_s
    config = EngineConfig(model=args.model, dtype=args.dtype, weights=args.weights,
                          cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
                          scheduler=SchedulerConfig())
    with LLM(config) as llm:
        scheduler = llm.core.config.scheduler
        variants = {"target_off": run_variant(llm, 0.0, args, 1),
                    f"target_{args.target_ms:g}ms": run_variant(llm, args.target_ms, args, 2)}
        dtype = llm.core.dtype
    off, on = variants.values()
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=here).stdout
    # Other work in progress in the same tree (a worker or kernel edit) changes the numbers.
    modified = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                              capture_output=True, text=True, cwd=here).stdout.split("\n")
    result = {
        "command": "python " + " ".join(["bench/itl_target_bench.py"] + sys.argv[1:]),
        "commit": commit.strip(),
        "uncommitted_changes": [line[3:] for line in modified if line.strip()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_info(),
        "engine": {"model": args.model, "dtype": dtype, "weights": args.weights, "tp": 1,
                   "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                   "max_num_seqs": scheduler.max_num_seqs,
                   "itl_min_prefill_share": scheduler.itl_min_prefill_share},
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "ignore_eos": True,
                     "arrival": "all at t = 0", "order": "target off first, then on"},
        "quiet": off["quiet"] and on["quiet"],
        "variants": variants,
        "on_over_off": {"itl_p99": on["itl_ms"]["p99"] / off["itl_ms"]["p99"],
                        "itl_p50": on["itl_ms"]["p50"] / off["itl_ms"]["p50"],
                        "ttft_p50": on["ttft_s"]["p50"] / off["ttft_s"]["p50"],
                        "ttft_p99": on["ttft_s"]["p99"] / off["ttft_s"]["p99"],
                        "output_tokens_per_s": (on["output_tokens_per_s"]
                                                / off["output_tokens_per_s"])},
        "peer": "vLLM 0.32 CPU fp32 on this machine, same workload online (issue 13): ITL p50 "
                "119 ms / p99 158 ms, TTFT p50 3.9 s, 202 output tok/s",
    }
    write_json(args.json, result)
    for name, v in variants.items():
        print(f"{name}: ITL p50 {v['itl_ms']['p50']:.0f} ms p99 {v['itl_ms']['p99']:.0f} ms, "
              f"TTFT p50 {v['ttft_s']['p50']:.2f} s p99 {v['ttft_s']['p99']:.2f} s, "
              f"{v['output_tokens_per_s']:.1f} output tok/s, load before {v['loadavg_before'][0]:.2f}"
              f"{'' if v['quiet'] else ' (not quiet)'}")


if __name__ == "__main__":
    main()
