"""What one request costs everyone else (issue 31 item 4): two ordinary streams decode while
one hostile request runs, and what they see is measured: every token's arrival, each
stream's worst gap between consecutive tokens, and /health/live's latency polled every
~100 ms. Baseline runs (the two streams alone) alternate with the hostile cases (baseline, A,
baseline, B, ...), so drift falls on both, over --runs rounds; each case's median worst gap is
reported against the baseline runs' median worst gap, and against its matched control's (an
ordinary request with a prompt of about the same length and no hostile option: what the option
itself costs). Every run's prompts
begin with their case and round, so no run reuses another's cached prompt blocks.

    nice -n 15 .venv/bin/python bench/one_request_cost.py                    # SmolLM2 (default)
    nice -n 15 .venv/bin/python bench/one_request_cost.py --model dummy:tiny --cases json_deep
    .venv/bin/python bench/one_request_cost.py --label after   # a second run kept beside the first

Writes bench/results/one_request_cost-<cpu kind>.json (runs under --label are merged into it):
per case the worst and p99 token gap, the ratio to the baseline, /health/live max and p99,
the hostile request's status and time; the CPU model and flags, the load average before each
run, the git commit and the command. Only 127.0.0.1; every request has a timeout and every
loop a bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STREAM_TOKENS = 96
HOSTILE_AFTER_TOKENS = 8
"""The hostile request starts once both streams have this many tokens: both are decoding."""
HEALTH_PERIOD_S = 0.1
REQUEST_TIMEOUT_S = 180.0
SPECIAL = "<|im_start|>"


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string", "maxLength": 8}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"],
                  "additionalProperties": False}
    return schema


def chat(model: str, content: str, **extra) -> dict:
    return {"model": model, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}], **extra}


CONTROLS = {"json_deep_50": "control_plain", "json_enum_10k": "control_plain",
            "regex_words": "control_plain", "logit_bias_300": "control_plain",
            "top_logprobs_20_stream": "control_plain", "top_logprobs_20_unread": "control_plain",
            "penalties_long_prompt": "long_prompt_plain"}
"""case -> the ordinary request it is matched with (its prompt's length, no hostile option)."""


def hostile_cases(model: str, vocab_size: int, tag: str = "") -> dict[str, dict]:
    """name -> {path, body, read}: read is 'stream' (read as it comes), 'full' (a non-streamed
    body) or 'unread' (sent on a bare socket, read only after the ordinary streams end). Each
    body's first message begins with the case's name and `tag`."""
    cases = _cases(model, vocab_size)
    for name, case in cases.items():
        first = case["body"]["messages"][0]
        first["content"] = f"[{name} {tag}] {first['content']}"
    return cases


def _cases(model: str, vocab_size: int) -> dict[str, dict]:
    rng = random.Random(0)
    enum = [f"value {i:05d} {rng.choice(['alpha', 'beta', 'gamma'])}" for i in range(10000)]
    bias = {str(t): rng.choice([-2.0, -1.0, 1.0, 2.0])
            for t in rng.sample(range(vocab_size), min(300, vocab_size))}
    long_prompt = " ".join(f"word{rng.randrange(5000)}" for _ in range(300))
    calls = 2000
    tool_chat = [{"role": "user", "content": "Look these up."},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"call_{i}", "type": "function",
                      "function": {"name": "lookup", "arguments": json.dumps({"i": i})}}
                     for i in range(calls)]}]
    tool_chat += [{"role": "tool", "tool_call_id": f"call_{i}", "content": "x" * 1000}
                  for i in range(calls)]
    special_messages = [{"role": "user" if i % 2 == 0 else "assistant",
                         "content": f"{SPECIAL} message {i} {SPECIAL}user hi<|im_end|>"}
                        for i in range(6000)]
    return {
        "control_plain": {"path": "/v1/chat/completions", "read": "stream",
                          "body": chat(model, "Tell me about the sea.", stream=True)},
        "json_deep_50": {"path": "/v1/chat/completions", "read": "stream", "body": chat(
            model, "Fill it in.", stream=True, response_format={
                "type": "json_schema", "json_schema": {"name": "deep",
                                                       "schema": deep_schema(50)}})},
        "json_enum_10k": {"path": "/v1/chat/completions", "read": "stream", "body": chat(
            model, "Pick one.", stream=True, response_format={
                "type": "json_schema", "json_schema": {"name": "enum", "schema": {
                    "type": "object", "properties": {"k": {"enum": enum}},
                    "required": ["k"]}}})},
        "regex_words": {"path": "/v1/chat/completions", "read": "stream", "body": chat(
            model, "Write words.", stream=True,
            structured_outputs={"regex": r"(\w+\s?){1,300}$"})},
        "logit_bias_300": {"path": "/v1/chat/completions", "read": "stream",
                           "body": chat(model, "Tell me about the sea.", stream=True,
                                        logit_bias=bias)},
        "penalties_long_prompt": {"path": "/v1/chat/completions", "read": "stream",
                                  "body": chat(model, long_prompt, stream=True,
                                               presence_penalty=1.5, frequency_penalty=1.5,
                                               repetition_penalty=1.3)},
        "long_prompt_plain": {"path": "/v1/chat/completions", "read": "stream",
                              "body": chat(model, long_prompt, stream=True)},
        "top_logprobs_20_stream": {"path": "/v1/chat/completions", "read": "stream",
                                   "body": chat(model, "Tell me about the sea.", stream=True,
                                                logprobs=True, top_logprobs=20)},
        "top_logprobs_20_unread": {"path": "/v1/chat/completions", "read": "unread",
                                   "body": chat(model, "Tell me about the sea.", stream=False,
                                                logprobs=True, top_logprobs=20)},
        "count_tokens_special_6k": {"path": "/v1/messages/count_tokens", "read": "full",
                                    "body": {"model": model, "messages": special_messages}},
        "tool_results_2k": {"path": "/v1/chat/completions", "read": "full",
                            "body": {**chat(model, ""), "messages": tool_chat,
                                     "tools": [{"type": "function", "function": {
                                         "name": "lookup", "parameters": {
                                             "type": "object",
                                             "properties": {"i": {"type": "integer"}}}}}]}},
    }


class Stream(threading.Thread):
    """One ordinary streaming chat request: the arrival time of each content event."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.arrivals: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client, client.stream(
                    "POST", self.url + "/v1/chat/completions", json=self.body) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}"
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("delta", {}).get("content"):
                        self.arrivals.append(time.perf_counter())
        except (httpx.HTTPError, ValueError) as error:
            self.error = repr(error)[:200]

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


class HealthPoller(threading.Thread):
    """GET /health/live every HEALTH_PERIOD_S until stopped (at most max_polls)."""

    def __init__(self, url: str, max_polls: int = 6000):
        super().__init__(daemon=True)
        self.url, self.max_polls = url, max_polls
        self.latencies: list[float] = []
        self.failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            for _ in range(self.max_polls):
                if self.stop.is_set():
                    return
                began = time.perf_counter()
                try:
                    client.get(self.url + "/health/live").raise_for_status()
                    self.latencies.append(time.perf_counter() - began)
                except httpx.HTTPError:
                    self.failures += 1
                self.stop.wait(max(0.0, HEALTH_PERIOD_S - (time.perf_counter() - began)))


class Hostile(threading.Thread):
    def __init__(self, url: str, case: dict):
        super().__init__(daemon=True)
        self.url, self.case = url, case
        self.status: int | None = None
        self.seconds: float | None = None
        self.error: str | None = None
        self.payload = json.dumps(case["body"]).encode()
        """Encoded before the run: encoding 2 MB on the client, beside the streams' readers,
        would be timed as the server's cost."""
        self.release = threading.Event()
        """'unread': set once the ordinary streams have ended; the body is read only then."""

    def run(self) -> None:
        began = time.perf_counter()
        try:
            if self.case["read"] == "unread":
                self._unread()
            else:
                self._read()
        except (httpx.HTTPError, OSError, ValueError) as error:
            self.error = repr(error)[:200]
        self.seconds = time.perf_counter() - began

    def _read(self) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client, client.stream(
                "POST", self.url + self.case["path"], content=self.payload,
                headers={"content-type": "application/json"}) as response:
            self.status = response.status_code
            for _ in response.iter_bytes():
                pass

    def _unread(self) -> None:
        host, port = self.url.split("//")[1].split(":")
        payload = self.payload
        with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(f"POST {self.case['path']} HTTP/1.1\r\nHost: {host}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                         "Connection: close\r\n\r\n".encode() + payload)
            self.release.wait(REQUEST_TIMEOUT_S)
            received = b""
            for _ in range(100000):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
            self.status = int(received.split(b" ", 2)[1]) if received else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def after_worst_gap(gaps: list[float], count: int = 4) -> list[float]:
    """The gaps that follow a stream's worst one. Tokens arriving together after it (gaps near
    0) were made but held in the gateway; tokens at the usual pace, not made: the engine
    stalled."""
    if not gaps:
        return []
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return [ms(gap) for gap in gaps[worst + 1:worst + 1 + count]]


def one_run(url: str, model: str, case: dict | None) -> dict:
    load = os.getloadavg()
    streams = [Stream(url, chat(model, prompt, stream=True))
               for prompt in ("Write a story about a lighthouse.", "Explain how rain forms.")]
    health = HealthPoller(url)
    health.start()
    for stream in streams:
        stream.start()
    hostile = Hostile(url, case) if case is not None else None
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while hostile is not None and time.monotonic() < deadline:
        if min(len(s.arrivals) for s in streams) >= HOSTILE_AFTER_TOKENS \
                or not any(s.is_alive() for s in streams):
            hostile.start()
            break
        time.sleep(0.005)
    for stream in streams:
        stream.join(REQUEST_TIMEOUT_S)
    if hostile is not None:
        hostile.release.set()
        if hostile.is_alive() or hostile.ident is not None:
            hostile.join(REQUEST_TIMEOUT_S)
    health.stop.set()
    health.join(30)
    gaps = [gap for s in streams for gap in s.gaps]
    return {"after_worst_gap_ms": [after_worst_gap(s.gaps) for s in streams],
        "load_before": [round(x, 2) for x in load],
        "worst_gap_ms": ms(max(gaps, default=None)),
        "p99_gap_ms": ms(percentile(gaps, 0.99)),
        "median_gap_ms": ms(statistics.median(gaps) if gaps else None),
        "worst_gap_per_stream_ms": [ms(max(s.gaps, default=None)) for s in streams],
        "tokens_per_stream": [len(s.arrivals) for s in streams],
        "stream_errors": [s.error for s in streams if s.error],
        "health_max_ms": ms(max(health.latencies, default=None)),
        "health_p99_ms": ms(percentile(health.latencies, 0.99)),
        "health_polls": len(health.latencies),
        "health_failures": health.failures,
        **({"hostile_status": hostile.status, "hostile_s": round(hostile.seconds or 0, 2),
            "hostile_error": hostile.error} if hostile is not None else {}),
    }


def wait_quiet(limit_s: float = 1800) -> None:
    """While /tmp/QUIET exists (another job on this machine asked for quiet), wait."""
    deadline = time.monotonic() + limit_s
    while os.path.exists("/tmp/QUIET") and time.monotonic() < deadline:
        time.sleep(30)


def summary(runs: dict[str, list[dict]], baselines: list[dict]) -> dict:
    """Per case the median over its runs, against the baselines' and its control's medians."""
    base_worst = statistics.median(r["worst_gap_ms"] for r in baselines)
    base_health = statistics.median(r["health_max_ms"] for r in baselines)
    out = {"baseline": {"worst_gap_ms": base_worst, "health_max_ms": base_health,
                        "runs": len(baselines)}}
    worst = {name: statistics.median(r["worst_gap_ms"] for r in case_runs)
             for name, case_runs in runs.items()}
    for name, case_runs in runs.items():
        health = statistics.median(r["health_max_ms"] for r in case_runs)
        control = CONTROLS.get(name)
        out[name] = {"worst_gap_ms": worst[name],
                     "worst_gap_each_ms": [r["worst_gap_ms"] for r in case_runs],
                     "p99_gap_ms": statistics.median(r["p99_gap_ms"] for r in case_runs),
                     "ratio_to_baseline": round(worst[name] / base_worst, 2),
                     **({"control": control,
                         "ratio_to_control": round(worst[name] / worst[control], 2)}
                        if control in worst else {}),
                     "health_max_ms": health,
                     "health_ratio": round(health / base_health, 2),
                     "hostile_status": [r.get("hostile_status") for r in case_runs],
                     "hostile_s": [r.get("hostile_s") for r in case_runs]}
    return out


def machine() -> dict:
    from tokstream.kernels import cpu_build

    flags = cpu_build.cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "tokstream"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    return {"cpu_kind": cpu_build.cpu_kind(), "cpu_model": cpu_build.cpu_model(),
            "flags": [f for f in wanted if f in flags], "cpus": os.cpu_count(),
            "commit": commit, "tokstream_dirty": dirty}


def main() -> None:
    from tokstream.serve_process import ServeProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the server's (SmolLM2)")
    parser.add_argument("--cases", default="", help="comma-separated subset")
    parser.add_argument("--runs", type=int, default=3, help="rounds over the cases")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="passed to tokstream serve (repeatable; e.g. "
                             "--serve-arg=--itl-target-ms --serve-arg=60)")
    parser.add_argument("--label", default="before")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from tokstream.kernels import cpu_build
    path = Path(args.json or ROOT / f"bench/results/one_request_cost-{cpu_build.cpu_kind()}.json")
    serve_args = ["--port", "0", "--host", "127.0.0.1"]
    if args.model:
        serve_args += ["--model", args.model]
    if args.model == "dummy:tiny":
        serve_args += ["--profile", "ci"]
    serve_args += args.serve_arg
    wait_quiet()
    with ServeProcess(serve_args, start_timeout_s=600, reap=True) as server:
        url = server.url
        info = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        model = info["id"]
        vocab = 512 if args.model == "dummy:tiny" else 49152  # dummy:tiny's, SmolLM2's
        chosen = [c for c in args.cases.split(",") if c] or list(hostile_cases(model, vocab))
        one_run(url, model, None)  # warm-up: first-request costs fall on no one measured
        baselines, runs = [], {name: [] for name in chosen}
        for round_ in range(args.runs):
            cases = hostile_cases(model, vocab, tag=f"round {round_}")
            for name in chosen:
                wait_quiet()
                baselines.append(one_run(url, model, None))
                wait_quiet()
                runs[name].append(one_run(url, model, cases[name]))
                print(f"{name}: {json.dumps(runs[name][-1])}", file=sys.stderr, flush=True)
        baselines.append(one_run(url, model, None))
    result = {"machine": machine(), "model": model, "stream_tokens": STREAM_TOKENS,
              "command": " ".join(["python", "bench/one_request_cost.py", *sys.argv[1:]]),
              "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "summary": summary(runs, baselines), "baseline_runs": baselines, "runs": runs}
    everything = json.loads(path.read_text()) if path.exists() else {}
    everything[args.label] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(everything, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
