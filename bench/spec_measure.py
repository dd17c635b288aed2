"""What spec_bench measures on a running server: streamed chat requests timed per output token
(1 or N streams at once), one run's figures from them, and the speculation counters of the
server's /metrics before and after."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from dataclasses import dataclass

import httpx

from compare_servers import MODEL_NAME
from spec_workload import Prompt

SPEC_COUNTERS = {"draft_tokens": "spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "spec_decode_num_accepted_tokens_total",
                 "drafts": "spec_decode_num_drafts_total"}
METRIC_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)")


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


def scrape(port: int) -> dict:
    try:
        return spec_counters(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}
