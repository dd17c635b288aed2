"""Speculative decoding, measured (issue 34 item 6): time per output token at 1 and 8 streams
on a copy-heavy mix (repeat / edit / extract a given text) and a free-form mix (stories,
explanations), each server with speculation off and on: tokstream's settings, vLLM's CPU
build with its n-gram proposer, llama.cpp's llama-server with its n-gram draft.

    .venv/bin/python bench/spec_bench.py            # -> bench/results/spec_bench-<cpu kind>.json
    .venv/bin/python bench/spec_bench.py --quick --only tokstream --tokstream-variants off,ngram

Workload: the chat completions route, streamed, greedy (temperature 0), max_tokens 128, no
ignore_eos by default: past its end-of-answer the model writes text that is no longer the copy
or the answer being timed, so each request is measured per token it actually produced (the
usage chunk's completion_tokens). --ignore-eos sends it; every server's ignore_eos is probed
either way. Per server variant, per mix and per stream count: the median over requests of
(last token time - first token time) / (tokens - 1), output tok/s over the run's wall time,
and the speculation counters of the server's /metrics (vLLM's and tokstream's `vllm:`
names, llama-server's `llamacpp:` ones) before and after.

Derived: the copy/free ratio of time per token at 1 stream per variant (issue 34's target for
tokstream's defaults: <= 0.5), and each speculating variant over its server's `off` on both
mixes at every stream count (target on free-form: throughput within 3%).

Each server runs alone: the script waits for a quiet load average (compare_machine's settle),
records it, starts the server, warms it up, measures, stops its process group. The helpers
(processes, the machine, the model folder, versions) are bench/compare_vllm.py's modules
(compare_servers, compare_machine, compare_peers, compare_probes, compare_contenders).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_contenders import serve_and_measure, tokstream_serve_available  # noqa: E402
from compare_machine import (NotQuiet, cpu_range, default_threads, host_info,  # noqa: E402
                             loadavg, settle)
from compare_peers import (DEFAULT_LLAMA_SERVER, DEFAULT_VENV, PEER_DIR,  # noqa: E402
                           ensure_hf_folder, gguf_info, resolve_gguf, versions)
from compare_probes import probe_ignore_eos  # noqa: E402
from compare_servers import MODEL_NAME, ROOT, cmdline, free_port  # noqa: E402
from tokstream.kernels import cpu_build  # noqa: E402

SERVERS = ("tokstream", "vllm", "llamacpp")
TARGET_COPY_OVER_FREE = 0.5  # issue 34: copy-heavy time per token <= 0.5x free-form's, 1 stream
TARGET_FREE_THROUGHPUT = 0.97  # issue 34: free-form throughput within 3% of speculation off
SPEC_COUNTERS = {"draft_tokens": "spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "spec_decode_num_accepted_tokens_total",
                 "drafts": "spec_decode_num_drafts_total"}
METRIC_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)")


def log(msg: str) -> None:
    print(f"[spec_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the prompts -------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    """One fixed chat request of a mix."""
    name: str
    task: str  # repeat | edit | extract (copy-heavy), story | explain (free-form)
    messages: tuple  # chat messages, one user turn

    @property
    def user(self) -> str:
        return self.messages[-1]["content"]


# Source texts for the copy-heavy tasks, each well over 128 tokens so that a copy of it runs
# to max_tokens. Written for this bench.
HARBOUR = (
    "The harbour at Elmsworth was rebuilt in 1887 after the great storm had carried away "
    "most of the old wooden piers. The new breakwater, designed by the engineer Marta "
    "Lindqvist, was made of granite blocks brought by rail from the quarries at Halden, "
    "each block weighing close to four tonnes. Work began in the spring and continued for "
    "three summers, employing more than two hundred men from the town and the farms around "
    "it. When the breakwater was finished it stretched 640 metres into the bay, and a small "
    "lighthouse with a red lamp was placed at its end. Fishing boats that had once waited "
    "outside the bay for the tide could now enter in any weather, and within ten years the "
    "number of boats registered at Elmsworth had doubled. The granite blocks are still "
    "visible today, although the lighthouse was replaced by an electric beacon in 1952.")
GARDEN = (
    "Every Saturday morning the community garden on Fenwick Street opens its gates at eight "
    "o'clock. Volunteers arrive with their own gloves and tools, and the coordinator, Daniel "
    "Okafor, hands out a list of jobs written on a small blackboard beside the shed. Some "
    "people water the raised beds of lettuce, beans and tomatoes, while others turn the "
    "compost heaps or repair the wooden fences that the wind has loosened during the week. "
    "At half past ten everyone stops for tea and bread baked by the bakery across the road, "
    "which gives the garden its leftover loaves. The vegetables that are ready for picking "
    "are packed into boxes and taken to the food bank on Mill Lane before noon. Last year "
    "the garden delivered 1,340 kilograms of vegetables, and this year the volunteers hope "
    "to reach 1,500 kilograms by planting a second row of potatoes along the north wall.")
BRIDGE = (
    "The old stone bridge over the river Arne has five arches and was finished in 1764. "
    "Travellers crossing the valley once paid a toll of two pennies at a small house on the "
    "eastern bank, where the toll keeper lived with his family. The bridge was widened in "
    "1903 so that two carts could pass each other, and iron railings were added on both "
    "sides. A mill stood just upstream, and its wheel turned day and night while there was "
    "enough water in the river. In the dry summer of 1921 the river almost stopped flowing "
    "and people walked across the riverbed beside the bridge. The mill closed in 1958 and its "
    "building became a museum about farming in the valley. Today the bridge carries only "
    "walkers and cyclists, since a concrete road bridge was built two kilometres to the "
    "south, and the toll house has become a café that sells ice cream in the summer.")
ORDER = (
    "Order number: 58213-KX\n"
    "Customer name: Priya Raman\n"
    "Delivery address: Flat 4, 27 Chestnut Avenue, Northfield, NF3 8QL\n"
    "Telephone: 0161 555 0187\n"
    "Items: two ceramic plant pots (large, glazed blue), one bag of potting compost (40 "
    "litres), one pair of garden gloves (size medium), three packets of sunflower seeds\n"
    "Payment: paid by card on 12 March, total 46.80 pounds\n"
    "Delivery notes: please leave the parcel with the neighbour at Flat 3 if nobody answers; "
    "the entrance is at the back of the building, through the green gate beside the bike "
    "shed, and the bell for Flat 4 does not work, so knock on the door\n"
    "Warehouse notes: pack the pots in separate boxes with extra paper, they broke last time")


def _chat(text: str) -> tuple:
    return ({"role": "user", "content": text},)


COPY_MIX = [
    Prompt("repeat_harbour", "repeat", _chat(
        "Repeat the following paragraph exactly, word for word, and write nothing else.\n\n"
        + HARBOUR)),
    Prompt("repeat_garden", "repeat", _chat(
        "Copy this text exactly as it is written:\n\n" + GARDEN)),
    Prompt("edit_bridge", "edit", _chat(
        "In the paragraph below, change the year 1764 to 1771. Return the whole paragraph "
        "with only that change.\n\n" + BRIDGE)),
    Prompt("edit_harbour", "edit", _chat(
        "Rewrite the paragraph below exactly, but replace the name Marta Lindqvist with "
        "Helena Brandt. Give the complete paragraph.\n\n" + HARBOUR)),
    Prompt("extract_order", "extract", _chat(
        "From the order below, copy out the customer name, the delivery address, the items "
        "and the delivery notes, exactly as written.\n\n" + ORDER)),
    Prompt("extract_bridge", "extract", _chat(
        "Copy out, word for word, every sentence of this text that mentions the bridge or "
        "the mill.\n\n" + BRIDGE)),
]
FREE_MIX = [
    Prompt("story_lighthouse", "story", _chat(
        "Write a short story about a lighthouse keeper who finds a message in a bottle.")),
    Prompt("story_robot", "story", _chat(
        "Tell a story about a small robot that wants to learn how to paint.")),
    Prompt("explain_vaccines", "explain", _chat(
        "Explain how vaccines train the immune system, in simple words.")),
    Prompt("explain_seasons", "explain", _chat(
        "Why does the Earth have seasons? Explain it to a twelve-year-old.")),
    Prompt("story_market", "story", _chat(
        "Write a story about a busy market day in a mountain village.")),
    Prompt("explain_bread", "explain", _chat(
        "Describe how bread rises and what yeast does in the dough.")),
]
MIXES = {"copy": COPY_MIX, "free": FREE_MIX}
WARMUP = [Prompt("warmup_tea", "warmup", _chat("How do I make a good cup of tea?")),
          Prompt("warmup_copy", "warmup", _chat(
              "Repeat exactly: the quick brown fox jumps over the lazy dog, twice."))]


# -- one streamed request ----------------------------------------------------------------

@dataclass
class RequestTiming:
    """One streamed chat completion as the client saw it (times from time.perf_counter)."""
    prompt: str
    sent_s: float
    first_s: float | None = None  # the first chunk carrying text
    last_s: float | None = None  # the last chunk carrying text
    tokens: int = 0  # usage.completion_tokens, else the text-carrying chunks
    chunks: int = 0  # text-carrying chunks (speculation may put several tokens in one)
    tokens_from: str = "usage"
    finish_reason: str | None = None
    server_draft: dict | None = None  # llama-server's per-request timings.draft_n(_accepted)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: what speculation changes."""
        if self.error or self.tokens < 2 or self.first_s is None or self.last_s is None:
            return None
        return (self.last_s - self.first_s) / (self.tokens - 1)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s


def request_body(prompt: Prompt, max_tokens: int, ignore_eos: bool) -> dict:
    body = {"model": MODEL_NAME, "messages": list(prompt.messages), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def read_stream(lines, timing: RequestTiming, clock=time.perf_counter) -> RequestTiming:
    """Fill `timing` from the SSE lines of a chat completion stream."""
    usage = None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data.get("error"):
            timing.error = str(data["error"])[:300]
            break
        usage = data.get("usage") or usage
        if data.get("timings", {}).get("draft_n") is not None:
            timing.server_draft = {"draft_n": data["timings"]["draft_n"],
                                   "draft_n_accepted": data["timings"].get("draft_n_accepted")}
        for choice in data.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                now = clock()
                timing.first_s = now if timing.first_s is None else timing.first_s
                timing.last_s = now
                timing.chunks += 1
            timing.finish_reason = choice.get("finish_reason") or timing.finish_reason
    if usage and usage.get("completion_tokens") is not None:
        timing.tokens = usage["completion_tokens"]
    else:
        timing.tokens, timing.tokens_from = timing.chunks, "chunks"
    return timing


def stream_chat(client: httpx.Client, port: int, prompt: Prompt, max_tokens: int,
                ignore_eos: bool, timeout_s: float) -> RequestTiming:
    timing = RequestTiming(prompt=prompt.name, sent_s=time.perf_counter())
    try:
        with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                           json=request_body(prompt, max_tokens, ignore_eos),
                           timeout=timeout_s) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {response.read()[:300]!r}"
                return timing
            return read_stream(response.iter_lines(), timing)
    except (httpx.HTTPError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"[:300]
        return timing


def run_streams(port: int, prompts: list[Prompt], streams: int, num_requests: int,
                max_tokens: int, ignore_eos: bool, timeout_s: float
                ) -> tuple[list[RequestTiming], float]:
    """num_requests requests (the prompts in turn), `streams` open at once; (timings, wall s)."""
    queue = [prompts[i % len(prompts)] for i in range(num_requests)]
    lock, timings = threading.Lock(), []

    def worker():
        with httpx.Client() as client:
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop(0)
                timing = stream_chat(client, port, prompt, max_tokens, ignore_eos, timeout_s)
                with lock:
                    timings.append(timing)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return timings, time.perf_counter() - start


# -- figures (pure) ----------------------------------------------------------------------

def spec_counters(metrics_text: str) -> dict:
    """Speculation counters of a Prometheus page, summed over label sets, by short name
    (any prefix: vllm: or llamacpp:); the per-position series are left out."""
    out = {key: 0.0 for key in SPEC_COUNTERS}
    found = False
    for line in metrics_text.splitlines():
        m = METRIC_LINE.match(line)
        if not m:
            continue
        name = m.group(1).split(":")[-1]
        for key, suffix in SPEC_COUNTERS.items():
            if name == suffix:
                out[key] += float(m.group(2))
                found = True
    return out if found else {}


def counter_delta(before: dict, after: dict) -> dict:
    if not before or not after:
        return {}
    out = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    out["acceptance_rate"] = (out["accepted_tokens"] / out["draft_tokens"]
                              if out["draft_tokens"] else None)
    return out


def summarize(timings: list[RequestTiming], wall_s: float, streams: int) -> dict:
    """One run's figures from its requests."""
    ok = [t for t in timings if not t.error]
    tpots = sorted(t.tpot_s for t in ok if t.tpot_s is not None)
    ttfts = sorted(t.ttft_s for t in ok if t.ttft_s is not None)
    tokens = sum(t.tokens for t in ok)
    chunks = sum(t.chunks for t in ok)
    out = {"streams": streams, "num_requests": len(timings), "completed": len(ok),
           "failed": len(timings) - len(ok),
           "errors": sorted({t.error for t in timings if t.error})[:5],
           "tpot_ms_median": statistics.median(tpots) * 1000 if tpots else None,
           "tpot_ms_mean": statistics.fmean(tpots) * 1000 if tpots else None,
           "tpot_ms_max": tpots[-1] * 1000 if tpots else None,
           "ttft_ms_median": statistics.median(ttfts) * 1000 if ttfts else None,
           "output_tokens": tokens, "wall_s": wall_s,
           "output_tok_per_s": tokens / wall_s if wall_s > 0 else None,
           "mean_tokens_per_request": tokens / len(ok) if ok else None,
           "tokens_per_chunk": tokens / chunks if chunks else None,
           "tokens_from": sorted({t.tokens_from for t in ok}),
           "finish_reasons": sorted({str(t.finish_reason) for t in ok})}
    drafts = [t.server_draft for t in ok if t.server_draft]
    if drafts:
        out["server_timings_draft"] = {
            "draft_n": sum(d["draft_n"] or 0 for d in drafts),
            "draft_n_accepted": sum(d["draft_n_accepted"] or 0 for d in drafts)}
    return out


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def figure(variant: dict, mix: str, streams: int, key: str):
    return ((variant.get("runs") or {}).get(mix) or {}).get(str(streams), {}).get(key)


def derive(servers: dict, streams: list[int]) -> dict:
    """The issue's figures from every measured variant: copy/free at 1 stream, and each
    speculating variant over its server's `off` per mix and stream count."""
    copy_over_free, over_off = {}, {}
    for server, block in servers.items():
        variants = block.get("variants") or {}
        off = variants.get("off")
        for name, variant in variants.items():
            key = f"{server}/{name}"
            copy_over_free[key] = ratio(figure(variant, "copy", 1, "tpot_ms_median"),
                                        figure(variant, "free", 1, "tpot_ms_median"))
            if off is None or name == "off":
                continue
            over_off[key] = {mix: {str(n): {
                "tpot": ratio(figure(variant, mix, n, "tpot_ms_median"),
                              figure(off, mix, n, "tpot_ms_median")),
                "throughput": ratio(figure(variant, mix, n, "output_tok_per_s"),
                                    figure(off, mix, n, "output_tok_per_s"))}
                for n in streams} for mix in MIXES}
    return {"copy_over_free_tpot_1_stream": copy_over_free, "over_off": over_off,
            "note": "tpot: time per output token (median over requests), <1 is faster; "
                    "throughput: output tok/s, >1 is faster"}


def targets(figures: dict, defaults_variant: str | None, streams: list[int]) -> dict:
    """Issue 34's targets for tokstream's defaults (the variant `serve --help` defaults to)."""
    key = f"tokstream/{defaults_variant}"
    copy = figures["copy_over_free_tpot_1_stream"].get(key)
    out = {"evaluated_on": key if defaults_variant else None,
           "copy_over_free_1_stream": {"value": copy, "target": TARGET_COPY_OVER_FREE,
                                       "met": None if copy is None else
                                       copy <= TARGET_COPY_OVER_FREE}}
    free = (figures["over_off"].get(key) or {}).get("free") or {}
    for n in streams:
        value = (free.get(str(n)) or {}).get("throughput")
        out[f"free_throughput_over_off_{n}_streams"] = {
            "value": value, "target": TARGET_FREE_THROUGHPUT,
            "met": None if value is None else value >= TARGET_FREE_THROUGHPUT}
    if defaults_variant == "off":
        out["note"] = "the defaults do not speculate: the over-off targets are not applicable"
    if 32 not in streams:
        out["not_measured"] = "32-stream throughput (add 32 to --streams)"
    return out


# -- variants ----------------------------------------------------------------------------

def option_text(help_text: str, flag: str) -> str:
    """The help entry of one option (its line and the wrapped ones under it)."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"{re.escape(flag)}(?![\w-])", line):
            text = line
            for more in lines[i + 1:i + 6]:
                if re.match(r"^[│|\s]*-", more) or not more.strip("│ "):
                    break
                text += " " + more
            return re.sub(r"[│╭╰─]+", " ", text)
    return ""


def speculative_modes(help_text: str) -> tuple[list[str], str | None]:
    """(the --speculative values `tokstream serve --help` names, its default)."""
    text = option_text(help_text, "--speculative")
    default = re.search(r"\[default:\s*\(?([\w-]+)\)?\]", text)
    modes = [m for m in ("off", "ngram", "auto") if re.search(rf"\b{m}\b", text)]
    return modes, default.group(1) if default else None


def tokstream_variant_args(name: str, k: int) -> list[str]:
    """Serve arguments of a tokstream variant: off, ngram, auto or NAME=ARGS (auto drafts up
    to k a step, as many as pay for themselves)."""
    if "=" in name:
        return shlex.split(name.partition("=")[2])
    if name == "off":
        return ["--speculative", "off"]
    return ["--speculative", name, "--num-speculative-tokens", str(k)]


def vllm_variant_args(name: str, k: int) -> list[str]:
    if name == "off":
        return []
    if name == "ngram":
        # The same drafting rule as tokstream's defaults: the longest suffix of 4 down to 2.
        return ["--speculative-config", json.dumps({
            "method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    raise ValueError(f"--vllm-variants: unknown {name!r} (off, ngram)")


def llamacpp_variant_args(name: str, k: int, size_n: int) -> list[str]:
    if name == "off":
        return []
    if name == "ngram":
        # ngram-simple: the last size_n tokens looked up earlier in the sequence, the k after
        # the match drafted (one lookup length, where tokstream and vLLM try 4 down to 2).
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(size_n),
                "--spec-ngram-simple-size-m", str(k)]
    raise ValueError(f"--llamacpp-variants: unknown {name!r} (off, ngram)")


def llamacpp_ngram_absent(help_text: str) -> str | None:
    if "--spec-type" not in help_text or "ngram-simple" not in help_text:
        return "this llama-server's --help names no --spec-type ngram-simple"
    return None


# -- one server --------------------------------------------------------------------------

def scrape(port: int) -> dict:
    try:
        return spec_counters(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}


def measure(args, port: int) -> dict:
    """Warm-up, then every mix at every stream count."""
    warm, _ = run_streams(port, WARMUP, max(args.streams), max(args.streams), 16,
                          args.ignore_eos, args.request_timeout)
    runs: dict = {"warmup_failed": sum(1 for t in warm if t.error)}
    for mix, prompts in MIXES.items():
        runs[mix] = {}
        for n in args.streams:
            count = (min(args.single_prompts, len(prompts)) if n == 1
                     else n * args.requests_per_stream)
            before = scrape(port)
            log(f"  {mix}, {n} stream(s), {count} requests")
            timings, wall = run_streams(port, prompts, n, count, args.max_tokens,
                                        args.ignore_eos, args.request_timeout)
            summary = summarize(timings, wall, n)
            summary["spec_counters"] = counter_delta(before, scrape(port))
            summary["requests"] = [dict(asdict(t), tpot_ms=None if t.tpot_s is None else
                                        t.tpot_s * 1000) for t in timings]
            runs[mix][str(n)] = summary
    return runs


def run_variant(args, name: str, cmd: list[str], env_extra: dict, work: str) -> dict:
    """One server config alone: settle, start, probe, measure, stop (whatever happened)."""
    port = free_port()
    full = cmd + ["--port", str(port)]
    out: dict = {"server_cmd": cmdline(full, env_extra)}
    out.update(settle(args, name))

    def probe_and_measure() -> None:
        out["ignore_eos_probe"] = {k: v for k, v in probe_ignore_eos(port).items()
                                   if k in ("accepted", "honoured", "conclusive")}
        out["runs"] = measure(args, port)
    return serve_and_measure(args, name, full, env_extra, work, port, out, probe_and_measure,
                             log=log, error_chars=2000, log_chars=300)


def run_server(args, server: str, variants: list[str], build, work: str, block: dict,
               absent: dict | None = None) -> None:
    """Each variant of one server, into block['variants'] (absent ones with their reason)."""
    block.setdefault("variants", {})
    block.setdefault("absent", {}).update(absent or {})
    for name in variants:
        if name in block["absent"]:
            log(f"{server}/{name}: absent ({block['absent'][name]})")
            continue
        cmd, env = build(name)
        result = run_variant(args, f"{server}_{name.partition('=')[0]}", cmd, env, work)
        if result.get("error") and not result.get("runs"):
            block["absent"][name] = f"failed before measuring: {result['error'][-600:]}"
            block.setdefault("failed_starts", {})[name] = result
        else:
            block["variants"][name.partition("=")[0]] = result


def tokstream_block(args, work: str, block: dict) -> None:
    ok, why, help_text = tokstream_serve_available(args)
    if not ok:
        block["absent"] = {v: why for v in args.tokstream_variants}
        return
    modes, default = speculative_modes(help_text)
    block.update(modes_listed=modes, defaults_variant=default)
    absent = {v: f"`tokstream serve --help` lists no --speculative {v} (it names {modes})"
              for v in args.tokstream_variants if "=" not in v and v not in modes}
    model = ["--model", args.gguf] if args.gguf else []
    run_server(args, "tokstream", args.tokstream_variants, lambda v: (
        [args.tokstream, "serve"] + model + tokstream_variant_args(v, args.k) +
        ["--host", "127.0.0.1", "--served-model-name", MODEL_NAME], {}), work, block, absent)


def vllm_block(args, work: str, block: dict) -> None:
    peer = os.path.join(args.vllm_venv, "bin", "vllm-peer")
    if not os.access(peer, os.X_OK):
        block["absent"] = {v: f"{peer} missing (scripts/setup_vllm_peer.sh)"
                           for v in args.vllm_variants}
        return
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_range(args.threads),
           "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    run_server(args, "vllm", args.vllm_variants, lambda v: (
        [peer, "serve", args.hf_folder, "--dtype", args.vllm_dtype, "--host", "127.0.0.1",
         "--served-model-name", MODEL_NAME] + vllm_variant_args(v, args.k) +
        (["--enforce-eager"] if args.enforce_eager else []), env), work, block)


def llamacpp_block(args, gguf: str, work: str, block: dict) -> None:
    if not os.access(args.llama_server, os.X_OK):
        block["absent"] = {v: f"{args.llama_server} missing (scripts/setup_llamacpp_peer.sh)"
                           for v in args.llamacpp_variants}
        return
    help_text = subprocess.run([args.llama_server, "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    why = llamacpp_ngram_absent(help_text)
    slots = max(args.streams)
    ctx = slots * args.llama_ctx_per_slot
    run_server(args, "llamacpp", args.llamacpp_variants, lambda v: (
        [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "-a", MODEL_NAME,
         "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-cb",
         "-c", str(ctx), "--metrics"] + shlex.split(args.llamacpp_extra_args) +
        llamacpp_variant_args(v, args.k, args.llamacpp_ngram_size_n), {}), work, block,
        {"ngram": why} if why else None)


# -- the run -----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SERVERS), help="comma list of " + ", ".join(SERVERS))
    p.add_argument("--tokstream-variants", default=None,
                   help="comma list of off, ngram, auto or NAME=SERVE_ARGS (default "
                        "off,ngram,auto; a mode serve --help does not list is skipped)")
    p.add_argument("--vllm-variants", default="off,ngram")
    p.add_argument("--llamacpp-variants", default="off,ngram")
    p.add_argument("--num-speculative-tokens", "-k", dest="k", type=int, default=4,
                   help="tokens drafted per step, for every server's ngram variant")
    p.add_argument("--streams", default=None, help="comma list (default 1,8; --quick: 1,4)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (--quick: 32)")
    p.add_argument("--single-prompts", type=int, default=None,
                   help="prompts of each mix at 1 stream (default all 6; --quick: 2)")
    p.add_argument("--requests-per-stream", type=int, default=None,
                   help="requests per stream at N > 1 streams (default 2; --quick: 1)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (see above)")
    p.add_argument("--tokstream", default=os.path.join(ROOT, ".venv", "bin", "tokstream"))
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 Q4_1")
    p.add_argument("--vllm-venv", default=DEFAULT_VENV)
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM --enforce-eager")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--hf-folder", default=os.path.join(PEER_DIR, "smollm2-hf"))
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER)
    p.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    p.add_argument("--llamacpp-ngram-size-n", type=int, default=3)
    p.add_argument("--llamacpp-extra-args", default="",
                   help="e.g. --no-repack (needed on the AMX VM, shared/REFERENCE.md)")
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--quiet-load", type=float, default=0.5)
    p.add_argument("--settle-timeout", type=float, default=None, help="default 180 (--quick 15)")
    p.add_argument("--require-quiet", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 and 4 streams, 32 tokens, 2 prompts a mix at 1 stream; "
                        "the JSON goes to the work folder unless --out is given")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--note", default=None)
    args = p.parse_args(argv)
    for name, full, quick in (("streams", "1,8", "1,4"), ("max_tokens", 128, 32),
                              ("single_prompts", 6, 2), ("requests_per_stream", 2, 1),
                              ("settle_timeout", 180.0, 15.0),
                              ("tokstream_variants", "off,ngram,auto", "off,ngram")):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    args.only = split(args.only)
    if bad := [s for s in args.only if s not in SERVERS]:
        p.error(f"--only: unknown {bad}")
    args.streams = sorted({int(n) for n in split(args.streams)})
    if 1 not in args.streams:
        p.error("--streams must include 1 (the copy/free target is at 1 stream)")
    for name in ("tokstream_variants", "vllm_variants", "llamacpp_variants"):
        setattr(args, name, split(getattr(args, name)))
    for name in ("vllm_variants", "llamacpp_variants"):
        if bad := [v for v in getattr(args, name) if v not in ("off", "ngram")]:
            p.error(f"--{name.replace('_', '-')}: unknown {bad} (off, ngram)")
    return args


def workload(args) -> dict:
    return {"route": "/v1/chat/completions, streamed, stream_options.include_usage",
            "temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
            "streams": args.streams, "single_stream_prompts": args.single_prompts,
            "requests_per_stream": args.requests_per_stream,
            "num_speculative_tokens": args.k, "threads": args.threads, "quick": args.quick,
            "warmup": f"{len(WARMUP)} other prompts x 16 tokens, not measured",
            "tpot": "median over requests of (last text chunk - first text chunk) / "
                    "(completion_tokens - 1)",
            "output_tok_per_s": "completion tokens of the run / its wall time",
            "prefix_cache": "the N-stream runs repeat the 1-stream prompts: prefix cache hits "
                            "shorten TTFT there, not the time per token",
            "vllm_dtype": args.vllm_dtype, "vllm_compiled": not args.enforce_eager,
            "order": "tokstream, vLLM, llama.cpp, each variant alone"}


def report_skeleton(args, work: str) -> dict:
    return {"what": __doc__.split("\n\n")[0], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": shlex.join([".venv/bin/python", "bench/spec_bench.py"] + sys.argv[1:]),
            "cpu_kind": cpu_build.cpu_kind(), "host": host_info(),
            "workload": workload(args), "note": args.note, "work_dir": work,
            "prompts": {mix: [{"name": p.name, "task": p.task, "user": p.user}
                              for p in prompts] for mix, prompts in MIXES.items()},
            "servers": {s: {} for s in args.only}}


def finish(report: dict, args, started: float) -> dict:
    servers = report["servers"]
    report["figures"] = derive(servers, args.streams)
    tok = servers.get("tokstream") or {}
    report["targets"] = targets(report["figures"], tok.get("defaults_variant"), args.streams)
    report["targets"]["per_tokstream_variant"] = {
        name: targets(report["figures"], name, args.streams) for name in tok.get("variants", {})}
    each = {f"{s}/{v}": r for s, b in servers.items()
            for v, r in (b.get("variants") or {}).items()}
    report["loadavg_before_each"] = {k: r["loadavg_before"][0] for k, r in each.items()}
    report["quiet"] = bool(each) and all(r.get("quiet") for r in each.values())
    report["absent"] = {f"{s}/{v}": why for s, b in servers.items()
                        for v, why in (b.get("absent") or {}).items()}
    report["loadavg_at_end"] = loadavg()
    report["wall_s"] = time.time() - started
    return report


def table(report: dict) -> str:
    rows = ["| variant | mix | streams | ms/token | tok/s | accepted/drafted |",
            "| --- | --- | --- | --- | --- | --- |"]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for server, block in report["servers"].items():
        for name, v in (block.get("variants") or {}).items():
            for mix, by_n in (v.get("runs") or {}).items():
                for n, r in (by_n.items() if isinstance(by_n, dict) else ()):
                    c = r.get("spec_counters") or {}
                    acc = (f"{c['accepted_tokens']:.0f}/{c['draft_tokens']:.0f}"
                           if c.get("draft_tokens") else "-")
                    rows.append(f"| {server}/{name} | {mix} | {n} | "
                                f"{fmt(r['tpot_ms_median'], '.1f')} | "
                                f"{fmt(r['output_tok_per_s'], '.1f')} | {acc} |")
    ratios = report["figures"]["copy_over_free_tpot_1_stream"]
    rows.append("\ncopy/free ms per token at 1 stream: " + ", ".join(
        f"{k} {fmt(v, '.2f')}" for k, v in ratios.items()))
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.hf_folder = os.path.abspath(args.hf_folder)
    work = args.work_dir or tempfile.mkdtemp(prefix="spec_bench-")
    os.makedirs(work, exist_ok=True)
    out_path = args.out or (os.path.join(work, "spec_bench_quick.json") if args.quick else
                            os.path.join(ROOT, "bench", "results",
                                         f"spec_bench-{cpu_build.cpu_kind()}.json"))
    log(f"logs in {work}")

    def _terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    started = time.time()
    report = report_skeleton(args, work)
    gguf = resolve_gguf(args)
    report["model"] = gguf_info(gguf)
    report["versions"] = versions(args)
    servers, rc = report["servers"], 0
    try:
        if "tokstream" in args.only:
            tokstream_block(args, work, servers["tokstream"])
        if "vllm" in args.only:
            report["model"]["hf_folder"] = ensure_hf_folder(args.hf_folder, report["model"],
                                                            work)
            vllm_block(args, work, servers["vllm"])
        if "llamacpp" in args.only:
            llamacpp_block(args, gguf, work, servers["llamacpp"])
    except NotQuiet as exc:
        report["aborted"] = f"--require-quiet: {exc}"
        rc = 3
    finally:
        finish(report, args, started)
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        log(f"wrote {out_path}")
    print(table(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
