"""The long-prompt flood in pure Python: the real Scheduler and block manager, a made-up step
cost standing in for the model (SmolLM2-like on a CPU: a fixed cost, a cost a decode, a cost a
prompt token and a (query, key) pair, and a step that carries prefill paying more), a simulated
clock, Poisson chat arrivals and bursts of long prompts. Finds which policy lets chat TTFT and
ITL grow under the flood without a model or a quiet machine (issue 29).

    .venv/bin/python bench/flood_sim.py                 # chat alone, then with the flood
    .venv/bin/python bench/flood_sim.py --long-share 1  # a setting changed

Prints chat TTFT/ITL percentiles and the flood prompts' TTFT for both runs. No torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokstream.config import SchedulerConfig  # noqa: E402
from tokstream.engine.block_manager import BlockManager  # noqa: E402
from tokstream.engine.request import Request  # noqa: E402
from tokstream.engine.scheduler.output import step_shape  # noqa: E402
from tokstream.engine.scheduler.scheduler import Scheduler  # noqa: E402
from tokstream.sampling_params import SamplingParams  # noqa: E402
from tokstream.stats import percentiles  # noqa: E402

SETTINGS = ("long_prefill_tokens", "long_prefill_share", "long_prefill_step_ms", "itl_target_ms",
            "itl_min_prefill_share", "max_num_batched_tokens")
"""SchedulerConfig fields the command line may set."""


@dataclasses.dataclass
class Machine:
    """Seconds a step takes: a + b*decodes (+ e + f*decodes with prefill) + c*prefill + d*pairs."""

    # Picked so chat alone looks like the quiet AMX Xeon (ITL p50 ~31-34 ms) and the
    # flood's three 8k prompts take a few seconds of prefill each: not a measurement.
    a: float = 0.020
    b: float = 0.002
    c: float = 0.0001
    d: float = 1e-8
    e: float = 0.012
    f: float = 0.0005

    def seconds(self, shape) -> float:
        mixed = shape.prefill_tokens > 0
        return (self.a + self.b * shape.num_decodes + self.c * shape.prefill_tokens
                + self.d * shape.attended_tokens
                + ((self.e + self.f * shape.num_decodes) if mixed else 0.0))


def arrivals(rng: random.Random, rate: float, duration: float, flood: bool, long_tokens: int):
    out, t, n = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        out.append((t, "chat", rng.randint(50, 400), rng.randint(32, 128)))
    if flood:
        for burst_at in range(5, int(duration), 20):
            out += [(float(burst_at), "flood", long_tokens, rng.randint(16, 64))] * 3
    return sorted(out)


def simulate(config: SchedulerConfig, machine: Machine, rate: float, duration: float,
             flood: bool, seed: int = 0, long_tokens: int = 8176, num_blocks: int = 8192,
             trace: bool = False) -> dict:
    rng = random.Random(seed)
    scheduler = Scheduler(config, BlockManager(num_blocks, 16, enable_caching=True),
                          max_model_len=8192, eos_token_ids=())
    now = [0.0]
    scheduler.clock = lambda: now[0]
    pending = arrivals(rng, rate, duration, flood, long_tokens)
    kinds, arrived, token_times = {}, {}, {}
    index = 0
    while index < len(pending) or scheduler.has_work:
        while index < len(pending) and pending[index][0] <= now[0]:
            at, kind, prompt, output = pending[index]
            rid = f"{kind}{index}"
            first = rng.randrange(100, 40000)
            scheduler.add_request(Request(
                rid, [first + i for i in range(prompt)],
                SamplingParams(max_tokens=output, temperature=0, ignore_eos=True), seed=0,
                arrival=at, cache_salt=rid))
            kinds[rid], arrived[rid], token_times[rid] = kind, at, []
            index += 1
        if not scheduler.has_work:
            now[0] = pending[index][0]
            continue
        out = scheduler.schedule()
        seconds = machine.seconds(step_shape(out.work))
        if trace:
            print(f"{now[0]:8.3f} {seconds * 1000:6.1f} ms",
                  [(w.request.request_id, w.num_tokens) for w in out.work if not w.is_decode],
                  f"decodes {sum(1 for w in out.work if w.num_tokens == 1)}"
                  f" waiting {[r.request_id for r in scheduler.waiting]}"
                  f"{' long first' if scheduler.prefill_policy.long_first else ''}"
                  f" share {scheduler.prefill_policy.long_share.share}")
        now[0] += seconds
        scheduler.observe_step(out, seconds)
        sampled = [7 for w in out.work if w.samples]
        for request in scheduler.update(out, sampled):
            token_times[request.request_id].append(now[0])
        if now[0] > duration + 600:
            break
    result = {}
    for kind in ("chat", "flood"):
        ids = [r for r in kinds if kinds[r] == kind]
        if not ids:
            continue
        ttft = [token_times[r][0] - arrived[r] for r in ids if token_times[r]]
        itl = [b - a for r in ids for a, b in zip(token_times[r], token_times[r][1:])]
        result[kind] = {"requests": len(ids), "first_tokens": len(ttft),
                        "ttft_ms": {k: round(v * 1000, 1) for k, v in
                                    percentiles(ttft).items() if v is not None},
                        "itl_ms": {k: round(v * 1000, 1) for k, v in
                                   percentiles(itl).items() if v is not None}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1.88)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="print every step of the flood run")
    for field in SETTINGS:
        parser.add_argument("--" + field.replace("_", "-"),
                            type=type(getattr(SchedulerConfig(), field)))
    for field in dataclasses.fields(Machine):
        parser.add_argument(f"--machine-{field.name}", type=float, default=field.default,
                            help=f"the made-up step cost's {field.name} (Machine's docstring)")
    args = parser.parse_args()
    overrides = {f: getattr(args, f) for f in SETTINGS if getattr(args, f) is not None}
    machine = Machine(**{f.name: getattr(args, f"machine_{f.name}")
                         for f in dataclasses.fields(Machine)})
    alone = simulate(SchedulerConfig(**overrides), machine, args.rate, args.duration, False,
                     args.seed)
    flood = simulate(SchedulerConfig(**overrides), machine, args.rate, args.duration, True,
                     args.seed, trace=args.trace)
    print(json.dumps({"settings": overrides, "chat_alone": alone, "flood": flood}, indent=1))


if __name__ == "__main__":
    main()
