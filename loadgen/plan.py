"""What to send and when, drawn from a seed: the same seed gives the same requests.

Each request is a pure function of (seed, stream, index), so the Locust process can draw
request n when a user needs it, and two runs with one seed send the same prompts lengths,
tenants and output budgets in the same order.

Lengths are absolute, as users state them; against a shorter context they are clamped: the
prompt first keeps room for the output budget, and when even the shortest prompt does not fit,
the output budget shrinks. A clamped request is marked so the report can count it, and so is
one drawn shorter than its class's chat template and system prompt allow (raised).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from tokstream.loadgen.mix import Mix, WorkloadClass


@dataclass
class RequestSpec:
    index: int
    workload: str
    tenant: str
    prompt_tokens: int
    """Input tokens to send (after clamping)."""
    requested_prompt_tokens: int
    max_tokens: int
    clamped: bool
    """The context made the prompt or the output budget shorter than drawn."""
    raised: bool
    """The prompt was drawn shorter than the class's minimum (template, system prompt) and was
    sent at that minimum."""
    burst: int | None = None
    """The burst this request belongs to (None: the main arrivals)."""
    key: str = ""
    """What it was drawn from ("main:7", "burst:flood:2:0"); its prompt's words are drawn from
    it too, so they do not depend on which user happened to send it."""

    def row(self) -> dict:
        return asdict(self)


@dataclass
class Limits:
    context: int
    """The served model's context (max_model_len), prompt + output."""
    min_prompt: dict[str, int]
    """Per class: the fewest input tokens its prompt can have (chat template, system prompt)."""


def _rng(seed: int, *key) -> random.Random:
    return random.Random(":".join(str(k) for k in (seed, *key)))


def _pick(rng: random.Random, shares: dict[str, float]) -> str:
    names = list(shares)
    return rng.choices(names, weights=[shares[n] for n in names])[0]


def draw_prompt_tokens(rng: random.Random, workload: WorkloadClass) -> int:
    low, high = workload.prompt_tokens
    if workload.prompt_distribution == "log-uniform":
        return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))
    return rng.randint(low, high)


def build_spec(mix: Mix, limits: Limits, workload: WorkloadClass, tenant: str,
               rng: random.Random, index: int, burst: int | None) -> RequestSpec:
    requested = draw_prompt_tokens(rng, workload)
    floor = limits.min_prompt[workload.name]
    wanted = max(requested, floor)
    if workload.output_tokens is None:
        prompt = min(wanted, limits.context - 1)
        max_tokens = drawn_output = limits.context - prompt
    else:
        drawn_output = rng.randint(*workload.output_tokens)
        prompt = max(floor, min(wanted, limits.context - drawn_output))
        max_tokens = min(drawn_output, limits.context - prompt)
    if max_tokens < 1:
        raise ValueError(f"class {workload.name}: its shortest prompt ({floor} tokens) fills "
                         f"the model's whole context ({limits.context})")
    clamped = prompt < wanted or max_tokens < drawn_output
    return RequestSpec(index, workload.name, tenant, prompt, requested, max_tokens, clamped,
                       requested < floor, burst)


def main_request(mix: Mix, limits: Limits, seed: int, index: int) -> RequestSpec:
    """Request `index` of the main arrivals: class by weight, tenant by share."""
    rng = _rng(seed, "main", index)
    workload_name = _pick(rng, {c.name: c.weight for c in mix.main_classes})
    workload = next(c for c in mix.classes if c.name == workload_name)
    spec = build_spec(mix, limits, workload, _pick(rng, mix.tenants), rng, index, None)
    spec.key = f"main:{index}"
    return spec


def burst_request(mix: Mix, limits: Limits, seed: int, workload: WorkloadClass, burst: int,
                  slot: int, index: int) -> RequestSpec:
    rng = _rng(seed, "burst", workload.name, burst, slot)
    spec = build_spec(mix, limits, workload, _pick(rng, mix.tenants), rng, index, burst)
    spec.key = f"burst:{workload.name}:{burst}:{slot}"
    return spec


def arrival_gaps(seed: int, arrival: str, rate: float, burstiness: float):
    """Open-loop inter-arrival gaps in seconds: exponential (poisson) or gamma with shape
    `burstiness` and the same mean (bursty; shape < 1 clumps arrivals together)."""
    rng = _rng(seed, "arrivals")
    while True:
        if arrival == "poisson" or burstiness == 1.0:
            yield rng.expovariate(rate)
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def burst_times(workload: WorkloadClass, duration_s: float, limit: int = 10_000):
    """When each burst of a class fires: every burst_every_s, from burst_every_s on."""
    n = 1
    while n <= limit and (not duration_s or n * workload.burst_every_s < duration_s):
        yield n, n * workload.burst_every_s
        n += 1
