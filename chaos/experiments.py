"""The experiments: what server each starts, what workload each sends, which fault it injects.

A workload is plain StreamSpecs. Streams mix the two APIs and three kinds of sampling (greedy,
seeded, unseeded), use ignore_eos so that their lengths are known (a fault must find them
still decoding), and draw every choice from the experiment's seeded random generator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from tokstream.errors import UserInputError

from tokstream.chaos.lifecycle_faults import (POISON_TOKEN, RAPID_DEATHS,
                                              START_TIMEOUTS_PER_STEP)
from tokstream.chaos.workload import StreamSpec

TOPICS = ("the sea", "a lighthouse keeper", "prime numbers", "a city at night", "bees",
          "the first computer", "a mountain village", "the moon landing", "a lost key",
          "an old library", "rain on a tin roof", "a chess match", "the northern lights",
          "a bakery at dawn", "a paper boat", "the last train home")
FILLER = "The quick brown fox jumps over the lazy dog while the river runs to the sea. "
PROMPT_ESTIMATE_TOKENS = 96
"""An upper bound on a decode stream's prompt (about 40-60 tokens with a chat template), to
size a KV pool before the server that could count them exists."""
TRIGGER_WINDOW_S = 1.5
MAX_LONG_CHUNKS = 64
SIGNALS = {"kill-rank": "SIGKILL", "stall-rank": "SIGSTOP", "kill-engine": "SIGKILL",
           "hang-engine": "SIGSTOP"}

STALE_BUDGET = 256
"""stale-prefix's token budget: a long prompt takes a whole step, unchunked."""
STALE_LONG_PROMPTS = 8


@dataclass
class Experiment:
    name: str
    summary: str
    fault: str | None
    """kill-rank | stall-rank | kill-engine | hang-engine: a signal; None: the workload is the
    fault."""
    default_streams: int
    serve_args: list[str] = field(default_factory=list)
    """Extra `tokstream serve` flags when the experiment starts its own server."""
    reference: str | None = "batch"
    """How the fault-free run of the greedy and seeded streams goes: batch (all at once, as
    in the experiment), solo (one at a time: the experiment itself changes batching), None."""
    serve_env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the server the experiment starts (a fault hook)."""
    own_server_only: bool = False
    """It stops the server (or needs a hook in it): never against --url, one round."""


def experiment(name: str, max_tokens: int, step_timeout_s: float) -> Experiment:
    # A small token budget spreads a long prompt's prefill over many steps, so a fault can
    # land in the middle of it.
    mid_batch = ["--max-num-batched-tokens", "64", "--max-prefill-chunk", "32",
                 "--step-timeout", str(step_timeout_s)]
    pool = 2 * math.ceil((PROMPT_ESTIMATE_TOKENS + max_tokens) / 16)
    return {
        "kill-rank": Experiment("kill-rank", "SIGKILL one tensor-parallel rank mid-batch "
                                "(streams decoding, a long prompt mid-prefill)", "kill-rank",
                                4, mid_batch),
        "stall-rank": Experiment("stall-rank", "SIGSTOP one rank (a hang) and leave it to the "
                                 "step deadline", "stall-rank", 4, mid_batch),
        "kill-engine": Experiment("kill-engine", "SIGKILL the engine core process",
                                  "kill-engine", 4, mid_batch),
        "hang-engine": Experiment("hang-engine", "SIGSTOP the engine core (a hang): its "
                                  "heartbeat stops, the gateway kills it and resumes every "
                                  "stream on a new core", "hang-engine", 4, mid_batch),
        "disconnect-storm": Experiment("disconnect-storm", "half the clients hang up at "
                                       "random moments", None, 8, reference=None),
        "cache-exhaustion": Experiment("cache-exhaustion", "a KV pool far too small for the "
                                       "load, forcing preemption", None, 8,
                                       ["--block-size", "16", "--num-blocks", str(pool)],
                                       reference="solo"),
        "slow-client": Experiment("slow-client", "clients that stop reading", None, 6,
                                  ["--max-pending-tokens", "32", "--slow-client-grace", "120"],
                                  reference=None),
        "drain": Experiment("drain", "SIGTERM the gateway mid-stream: every stream runs to "
                            "its end, new requests are refused, the server then exits", None,
                            4, ["--shutdown-timeout", "300"], reference=None,
                            own_server_only=True),
        "poison-request": Experiment(
            "poison-request", "a request whose prefill kills rank 0 every time: it is ended "
            "with an error, the others go on", None, 4, mid_batch,
            serve_env={"TOKSTREAM_POISON": f"rank:{POISON_TOKEN}"}, own_server_only=True),
        "hang-on-start": Experiment(
            "hang-on-start", "SIGKILL the engine core, SIGSTOP its replacement: the start "
            "deadline kills it and another takes over", None, 4,
            [*mid_batch, "--start-timeout", str(START_TIMEOUTS_PER_STEP * step_timeout_s)]),
        "rapid-core-deaths": Experiment(
            "rapid-core-deaths", f"SIGKILL the engine core, then each replacement as soon as "
            f"it serves, {RAPID_DEATHS} times: no request is blamed, every stream completes",
            # No block is adopted: each new core re-prefills the streams over several steps,
            # so it serves one while the others still wait (what blamed them, issue 31).
            None, 4, [*mid_batch, "--no-prefix-caching"]),
        "stale-prefix": Experiment(
            "stale-prefix", "SIGKILL rank 0 while a waiting request holds cached prefix "
            "blocks behind long unchunked prompts", None, STALE_LONG_PROMPTS + 2,
            ["--no-chunked-prefill", "--max-num-batched-tokens", str(STALE_BUDGET),
             "--step-timeout", str(step_timeout_s)],
            # The core checks its blocks after every step too, so a waiting request holding
            # blocks is caught whether or not the kill lands while it waits.
            serve_env={"TOKSTREAM_SELF_CHECK": "1"}),
    }[name]


@dataclass
class ServerFacts:
    """What sizing a workload needs to know about the server (from /v1/state)."""

    model: str
    token_budget: int
    prefill_chunk: int
    """Most prompt tokens of one request per step."""
    max_model_len: int
    num_blocks: int
    block_size: int
    tokens_per_filler: float
    """Prompt tokens one FILLER sentence adds."""
    step_s: float = 0.1
    """About how long one engine step takes (measured on the reference run)."""


def message(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def decode_stream(i: int, rng: random.Random, model: str, max_tokens: int) -> StreamSpec:
    """Stream i: greedy, seeded or unseeded in turn; every fourth on OpenAI's chat route and
    every fourth from the second on its Responses API, the rest on the Anthropic route."""
    topic = TOPICS[i % len(TOPICS)]
    kind = i % 3
    sampling = ({"temperature": 0} if kind == 0 else
                {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**31)} if kind == 1
                else {"temperature": 0.8})
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "messages": message(f"Write a long story about {topic}."), **sampling}
    if i % 4 == 3:
        return StreamSpec(f"s{i}", "/v1/chat/completions",
                          {**body, "stream_options": {"include_usage": True}})
    if i % 4 == 1:
        body.pop("max_tokens")
        return StreamSpec(f"s{i}", "/v1/responses", {
            **body, "max_output_tokens": max_tokens, "input": body.pop("messages")})
    return StreamSpec(f"s{i}", "/v1/messages", body)


def long_prompt_stream(facts: ServerFacts, round_index: int, seed: int, max_tokens: int,
                       attempt: int = 0) -> StreamSpec:
    """A prompt whose prefill spans many steps: more than it takes the decoding streams to
    reach the trigger (at most max_tokens / 3 tokens), and on a fast model about
    TRIGGER_WINDOW_S of steps (so that /v1/state polls, which come between steps, see it
    mid-prefill); at most half the context. Different in every round and attempt so the
    prefix cache cannot skip its prefill."""
    chunks = min(MAX_LONG_CHUNKS, max(12, max_tokens // 3 + 6,
                                      math.ceil(TRIGGER_WINDOW_S / facts.step_s)))
    target = min(chunks * facts.prefill_chunk, facts.max_model_len // 2)
    count = max(1, round(target / facts.tokens_per_filler))
    text = (f"Round {round_index}, seed {seed}, attempt {attempt}. Summarise this text. "
            + FILLER * count)
    return StreamSpec("long" if attempt == 0 else f"long{attempt}", "/v1/messages", {
        "model": facts.model, "max_tokens": 8, "stream": True, "ignore_eos": True,
        "temperature": 0, "messages": message(text)}, role="long-prompt")


def workload(exp: Experiment, facts: ServerFacts, num_streams: int, max_tokens: int, seed: int,
             round_index: int) -> list[StreamSpec]:
    """The round's streams (for the signal experiments the long prompt comes separately, sent
    when the trigger is near: long_prompt_stream). The streams' prompts and seeds are the same in every round (so one
    fault-free reference run serves them all); who hangs up or stops reading, and when,
    changes from round to round."""
    base, rng = random.Random(seed), random.Random(f"{seed}/{round_index}/workload")
    if exp.name == "disconnect-storm":
        specs = [decode_stream(i, base, facts.model, max_tokens) for i in range(num_streams)]
        for spec in rng.sample(specs, num_streams // 2):
            spec.hang_up_after = rng.randint(1, max_tokens - 1)
        return specs
    if exp.name == "cache-exhaustion":
        return [decode_stream(i, base, facts.model, exhausting_max_tokens(facts, num_streams,
                                                                          max_tokens))
                for i in range(num_streams)]
    if exp.name == "poison-request":
        specs = [decode_stream(i, base, facts.model, max_tokens) for i in range(num_streams)]
        return specs + [StreamSpec("poison", "/v1/completions", {
            "model": facts.model, "prompt": [POISON_TOKEN, 5, 17, 9, 9, 11], "max_tokens": 8,
            "stream": True, "temperature": 0}, role="poison")]
    if exp.name == "stale-prefix":
        return stale_prefix_streams(facts, max_tokens, seed, round_index)
    if exp.name == "slow-client":
        specs = []
        for i in range(num_streams):
            slow = i % 2 == 1
            spec = decode_stream(i, base, facts.model, SLOW_MAX_TOKENS if slow else max_tokens)
            if slow:
                spec.stop_reading_after = rng.randint(1, 8)
                spec.role = "slow"
            specs.append(spec)
        return specs
    return [decode_stream(i, base, facts.model, max_tokens) for i in range(num_streams)]


def stale_prefix_streams(facts: ServerFacts, max_tokens: int, seed: int,
                         round_index: int) -> list[StreamSpec]:
    """P (a prompt of many full blocks), long prompts of about a step's budget each, and C:
    P's text and a question after it, so C's prefix is P's cached blocks. Different in each
    round so the long prompts are never cached themselves."""
    text = f"Seed {seed}. " + FILLER * max(1, round(48 / facts.tokens_per_filler))
    sentences = max(1, round((STALE_BUDGET - 48) / facts.tokens_per_filler))

    def greedy(name: str, content: str, role: str, tokens: int) -> StreamSpec:
        return StreamSpec(name, "/v1/messages", {
            "model": facts.model, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "messages": message(content)}, role=role)

    return [greedy("prefix", text, "decode", 4),
            *[greedy(f"long{i}", f"Round {round_index}, part {i}. " + FILLER * sentences,
                     "long-prompt", 4) for i in range(STALE_LONG_PROMPTS)],
            greedy("sharer", text + " What is this about?", "prefix-sharer", max_tokens)]


SLOW_MAX_TOKENS = 1500
"""Long enough that a client reading nothing fills its socket and the server's pending limit."""


def exhausting_max_tokens(facts: ServerFacts, num_streams: int, max_tokens: int) -> int:
    """max_tokens per stream such that the streams together need at least twice the pool, and
    any two at once more than all of it (a stream's output alone is half the pool): on a fast
    server streams sent together still reach it spread out, and short ones would end before
    the last has arrived."""
    pool_tokens = facts.num_blocks * facts.block_size
    needed = max(math.ceil(2 * pool_tokens / num_streams) - PROMPT_ESTIMATE_TOKENS,
                 pool_tokens // 2)
    tokens = max(max_tokens, needed)
    if tokens + PROMPT_ESTIMATE_TOKENS > facts.max_model_len:
        raise UserInputError(
            f"the server's KV pool ({pool_tokens} tokens) is too large to exhaust with "
            f"{num_streams} streams of at most {facts.max_model_len} tokens; pass more "
            "--streams, or let chaos start its own server (it uses a small pool)")
    return tokens


def trigger_point(rng: random.Random, num_streams: int, max_tokens: int) -> tuple[int, int]:
    """(j, k): the fault fires once stream j has received k tokens."""
    return rng.randrange(num_streams), rng.randint(2, max(2, max_tokens // 3))
