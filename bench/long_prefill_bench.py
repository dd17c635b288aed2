"""Chat requests that arrive behind a long prompt: first come, first served
(long_prefill_share = 1) against the default share (0.5), side by side on one engine.

A long prompt arrives at t = 0; chat requests (32-64-token prompts, 32 output tokens) arrive
every 0.5 s while it is prefilled. Reported per variant: chat TTFT and ITL (p50/p99/max), the
long prompt's TTFT, and their ratios between the two variants.

    .venv/bin/python bench/long_prefill_bench.py                    # SmolLM2, 6,000 tokens
    .venv/bin/python bench/long_prefill_bench.py --model dummy:tiny-64k --long-tokens 40000

Writes bench/results/long_prefill_bench.json. No torch in this process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scheduler_driver import Arrival, drive, engine, random_tokens  # noqa: E402
from scheduler_results import write_json  # noqa: E402
from tokstream.stats import percentiles  # noqa: E402
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "long_prefill_bench.json")


def run_variant(core, share: float, args, seed: int) -> dict:
    core.config.scheduler.long_prefill_share = share  # read afresh every step
    rng = random.Random(seed)  # fresh prompts: no prefix-cache hits between variants
    vocab = core.model_config.vocab_size
    long_len = min(args.long_tokens, core.max_model_len - 8)
    ids = itertools.count()
    chat = SamplingParams(max_tokens=args.chat_output, temperature=0, ignore_eos=True)
    arrivals = [Arrival(0.0, EngineRequest("long", random_tokens(rng, long_len, vocab),
                                           SamplingParams(max_tokens=4, temperature=0,
                                                          ignore_eos=True)), "long")]
    arrivals += [Arrival(0.5 + 0.5 * i, EngineRequest(
        f"chat{next(ids)}", random_tokens(rng, rng.randint(32, 64), vocab), chat), "chat")
        for i in range(args.chats)]

    def done(run, now):
        traces = run.traces.values()
        return (len(run.traces) == len(arrivals)
                and all(t.finish_reason for t in traces if t.kind == "chat")
                and run.traces["long"].token_times)

    run = drive(core, arrivals, duration=args.timeout, stop=done)
    chats = [t for t in run.traces.values() if t.kind == "chat"]
    ttft = [t.ttft for t in chats if t.ttft is not None]
    gaps = [end - begin for t in chats for begin, end in t.itls()]
    return {"long_prefill_share": share, "long_prompt_tokens": long_len,
            "chat_ttft_s": {**percentiles(ttft), "max": max(ttft, default=None)},
            "chat_itl_ms": {k: (v * 1000 if v is not None else None) for k, v in
                            {**percentiles(gaps), "max": max(gaps, default=None)}.items()},
            "chats_finished": sum(bool(t.finish_reason) for t in chats),
            "long_ttft_s": run.traces["long"].ttft, "elapsed_s": run.elapsed,
            "loadavg_after": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2")
    add("--dtype", default="auto")
    add("--kv-cache-memory", type=int, default=1 << 30)
    add("--long-tokens", type=int, default=6000)
    add("--chats", type=int, default=8)
    add("--chat-output", type=int, default=32)
    add("--timeout", type=float, default=600.0)
    add("--json", default=RESULTS)
    args = parser.parse_args()
    with engine(args) as llm:
        variants = {"fcfs_share_1": run_variant(llm.core, 1.0, args, 1),
                    "share_0.5": run_variant(llm.core, 0.5, args, 2)}
    fcfs, share = variants["fcfs_share_1"], variants["share_0.5"]
    result = {
        "model": args.model, "load_average_at_end": os.getloadavg(),
        "variants": variants,
        "chat_ttft_p50_ratio_fcfs_over_share":
            fcfs["chat_ttft_s"]["p50"] / share["chat_ttft_s"]["p50"],
        "long_ttft_ratio_share_over_fcfs": share["long_ttft_s"] / fcfs["long_ttft_s"],
    }
    write_json(args.json, result)
    for name, v in variants.items():
        print(f"{name}: chat TTFT p50 {v['chat_ttft_s']['p50']:.2f} s max "
              f"{v['chat_ttft_s']['max']:.2f} s, chat ITL p99 {v['chat_itl_ms']['p99']:.0f} ms, "
              f"long TTFT {v['long_ttft_s']:.2f} s")
    print(f"chat TTFT p50 {result['chat_ttft_p50_ratio_fcfs_over_share']:.1f}x lower with the "
          f"share; long prompt's TTFT {result['long_ttft_ratio_share_over_fcfs']:.2f}x")


if __name__ == "__main__":
    main()
