"""`tokstream loadtest` plumbing against a local fake SSE server (a test double of the server).

The fake speaks tokstream's wire format (Anthropic and OpenAI streams with the integrity
extension, count_tokens, /v1/models) with a toy tokenizer (a token per word or punctuation
mark), and breaks chosen requests on purpose: a dropped token, a wrong usage count, an error
mid-stream, a 529, a stream cut without an end.
"""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from helpers.loadtest_run import KEYS, TENANTS, loadtest, write_mix
from helpers.serving import interruptible
from tokstream.engine.messages.request import token_digest
from tokstream.loadgen.plots import PLOTS
from tokstream.loadgen.stream import auth_headers, request_body, stream_request

TEMPLATE_TOKENS = 7


def toy_count(texts) -> int:
    return TEMPLATE_TOKENS + sum(len(re.findall(r"\w+|[^\w\s]", t)) for t in texts)


class FakeServer:
    """`with FakeServer(context=1024) as fake:`; set fake.fault(n) -> mode for request n."""

    def __init__(self, context: int = 4096, token_delay_s: float = 0.002, keys=None):
        self.context, self.token_delay_s, self.keys = context, token_delay_s, keys
        self.fault = lambda n: None
        self.metrics = None
        """A callable giving /metrics' text (None: /metrics is not found)."""
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def __enter__(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/v1/models":
                    self.reply(200, {"data": [{"id": "toy", "max_model_len": fake.context}]})
                elif self.path == "/metrics" and fake.metrics is not None:
                    data = fake.metrics().encode()
                    self.send_response(200)
                    self.send_header("content-type", "text/plain; version=0.0.4")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self.reply(404, {"type": "error", "error": {"type": "not_found_error"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                key = self.headers.get("x-api-key") or \
                    (self.headers.get("authorization") or "").removeprefix("Bearer ") or None
                if fake.keys is not None and key not in fake.keys:
                    return self.reply(401, {"type": "error", "error": {
                        "type": "authentication_error", "message": "bad key"}})
                texts = [m["content"] for m in body["messages"]] + \
                    ([body["system"]] if "system" in body else [])
                prompt_tokens = toy_count(texts)
                if self.path == "/v1/messages/count_tokens":
                    return self.reply(200, {"input_tokens": prompt_tokens})
                with fake.lock:
                    n = len(fake.requests)
                    fake.requests.append({"tenant": (fake.keys or {}).get(key),
                                          "prompt_tokens": prompt_tokens, "body": body})
                mode = fake.fault(n)
                if mode == "529":
                    return self.reply(529, {"type": "error", "error": {
                        "type": "overloaded_error", "message": "busy"}})
                self.stream(body, prompt_tokens, mode, f"req{n}",
                            openai=self.path == "/v1/chat/completions")

            def reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def event(self, name, data, event_id=None):
                head = (f"event: {name}\n" if name else "") + \
                    (f"id: {event_id}\n" if event_id is not None else "")
                self.wfile.write(f"{head}data: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()

            def stream(self, body, prompt_tokens, mode, rid, openai):
                try:
                    self.write_stream(body, prompt_tokens, mode, rid, openai)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on it (drain timeout): as a server sees it

            def write_stream(self, body, prompt_tokens, mode, rid, openai):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                tokens = [(7 * i + 3) % 500 for i in range(body["max_tokens"])]
                if not openai:
                    self.event("message_start", {"type": "message_start", "message": {
                        "id": rid, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
                    self.event("ping", {"type": "ping"})
                for index, token in enumerate(tokens):
                    time.sleep(fake.token_delay_s)
                    if mode in ("error", "cut") and index == 2:
                        if mode == "error":
                            self.event("error", {"type": "error", "error": {
                                "type": "overloaded_error", "message": "replica down"}})
                        return
                    if mode == "drop" and index == 1:
                        continue
                    ext = {"request_id": rid, "token_ids": [token], "indices": [index]}
                    if openai:
                        self.event(None, {"id": rid, "choices": [{"delta": {"content": "x"}}],
                                          "tokstream": ext}, index)
                    else:
                        self.event("content_block_delta", {
                            "type": "content_block_delta", "delta": {"text": " x"},
                            "tokstream": ext}, index)
                final = {"request_id": rid, "num_output_tokens": len(tokens),
                         "digest": token_digest(tokens), "finish_reason": "length"}
                reported = len(tokens) + (1 if mode == "usage" else 0)
                if openai:
                    self.event(None, {"id": rid, "choices": [{"delta": {},
                                                              "finish_reason": "length"}],
                                      "tokstream": final})
                    self.event(None, {"id": rid, "choices": [], "usage": {
                        "prompt_tokens": prompt_tokens, "completion_tokens": reported}})
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self.event("message_delta", {"type": "message_delta", "usage": {
                        "output_tokens": reported}, "tokstream": final})
                    self.event("message_stop", {"type": "message_stop"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def one(fake, api="anthropic", max_tokens=6, key=None):
    body = request_body(api, "toy", "hello there", None, max_tokens, 0.0, True)
    with httpx.Client(timeout=30) as client:
        return stream_request(client, fake.url, api, body, auth_headers(api, key), 30)


def kinds(sample):
    return sorted(p["kind"] for p in sample["integrity"])


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_stream_is_timed_per_token_and_checked(api):
    modes = {1: "drop", 2: "usage", 3: "error", 4: "529", 5: "cut"}
    with FakeServer(token_delay_s=0.01) as fake:
        fake.fault = modes.get
        ok, drop, usage, error, busy, cut = [one(fake, api) for _ in range(6)]
    assert ok["status"] == "ok" and not ok["integrity"]
    assert ok["event_tokens"] == [1] * 6 and len(ok["event_times_s"]) == 6
    # causality, not speed: token i cannot arrive before the fake slept i + 1 times
    assert ok["event_times_s"] == sorted(ok["event_times_s"])
    assert all(t >= 0.01 * (i + 1) for i, t in enumerate(ok["event_times_s"]))
    assert (ok["input_tokens"], ok["output_tokens"], ok["tokens_counted"]) == \
        (toy_count(["hello there"]), 6, 6)
    assert ok["request_id"] == "req0" and ok["finish_reason"] == "length"
    assert kinds(drop) == ["count_mismatch", "digest_mismatch", "lost", "usage_mismatch"]
    assert kinds(usage) == ["usage_mismatch"]
    assert error["status"] == "error" and error["error_type"] == "overloaded_error"
    assert error["tokens_counted"] == 2 and not error["integrity"]  # ended once, explicitly
    assert busy["status"] == "error" and busy["http_status"] == 529
    assert busy["error_type"] == "overloaded_error"
    assert cut["status"] == "error" and cut["error_type"] == "cut"
    assert kinds(cut) == ["never_ended"]


def test_unreachable_server_is_a_connection_error_sample():
    fake = type("Gone", (), {"url": f"http://127.0.0.1:{free_port()}"})
    sample = one(fake)
    assert sample["status"] == "error" and sample["error_type"] == "connection_error"


CLASSES = [{"name": "short", "weight": 2, "prompt_tokens": [30, 120], "output_tokens": [3, 8]},
           {"name": "long", "prompt_tokens": [200, 2000], "prompt_distribution": "log-uniform",
            "output_tokens": 10, "shared_prefix_tokens": 100}]


def write_mix_and_keys(tmp_path):
    return write_mix(tmp_path, {"users": 3}, CLASSES, TENANTS)


@pytest.mark.startup
def test_loadtest_reports_every_request(tmp_path):
    mix, keys = write_mix_and_keys(tmp_path)
    out = tmp_path / "out"
    with FakeServer(context=1024, keys=KEYS) as fake:
        result = loadtest("--url", fake.url, "--mix", mix, "--keys", keys,
                          "--requests", "16", "--duration", "0", "--seed", "3",
                          "--slo", "ttft=10,itl=5", "--out", str(out))
        served = list(fake.requests)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    samples = report["samples"]
    assert len(samples) == 16 == len(served)
    for block in [report["summary"], *report["class"].values(), *report["tenant"].values()]:
        for key in ("completed", "failed", "output_tokens_per_s", "goodput"):
            assert key in block
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert set(block[key]) >= {"p50", "p90", "p99"}
    assert set(report["class"]) == {"short", "long"} and set(report["tenant"]) == {"alpha",
                                                                                  "beta"}
    summary = report["summary"]
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["integrity"] == {"streams_checked": 16, "streams_failed": 0, "problems": {}}
    # exact lengths: what the server counted is what the plan asked for, request by request
    by_order = sorted(samples, key=lambda s: s["start_s"])
    assert summary["prompt_tokens_mismatched"] == 0
    assert sorted(s["prompt_tokens"] for s in samples) == \
        sorted(r["prompt_tokens"] for r in served)
    # the 1,024-token context clamps long prompts (requested up to 2,000) and the report says so
    clamped = [s for s in samples if s["clamped"]]
    assert summary["clamped"] == len(clamped) > 0
    assert all(s["prompt_tokens"] + s["max_tokens"] <= 1024 for s in samples)
    assert all(s["prompt_tokens"] == 1024 - 10 for s in clamped)
    # each request went out under its own tenant's key
    assert sorted(s["tenant"] for s in samples) == sorted(r["tenant"] for r in served)
    # the long class shares one system prompt; every user's text differs
    assert len(served) == len({json.dumps(r["body"]["messages"]) for r in served})
    systems = [r["body"].get("system") for r in served]
    long_ones = sum(1 for s in samples if s["workload"] == "long")
    assert len(set(filter(None, systems))) == 1 and sum(map(bool, systems)) == long_ones > 0
    assert summary["goodput"]["requests"] == 16
    assert report["locust"]["stream short"]["requests"] + \
        report["locust"]["stream long"]["requests"] == 16
    assert report["verdict"] == {"ok": True, "reasons": []}
    assert "By workload class" in result.stdout and "Jain" in result.stdout
    assert by_order[0]["ttft_s"] is not None
    # the report files load and plot: the PNGs are real images, and plots redraw from the JSON
    import matplotlib.image
    from tokstream.loadgen.plots import plot_report

    for name in PLOTS:
        assert matplotlib.image.imread(out / name).shape[0] > 100
    redrawn = plot_report(report, tmp_path / "again")
    assert [p.name for p in redrawn] == list(PLOTS) and all(p.stat().st_size > 5000
                                                            for p in redrawn)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.startup
def test_loadtest_fails_past_the_thresholds_and_shows_locusts_web_ui(tmp_path):
    mix, keys = write_mix_and_keys(tmp_path)
    out = tmp_path / "out"
    port = free_port()
    with FakeServer(keys=KEYS, token_delay_s=0.03) as fake:
        fake.fault = lambda n: {3: "drop", 5: "529", 8: "cut"}.get(n)
        process = subprocess.Popen(
            [sys.executable, "-m", "tokstream", "loadtest", "--url", fake.url, "--mix", mix,
             "--keys", keys, "--requests", "12", "--duration", "0", "--users", "1",
             "--max-error-rate", "0.05", "--api", "openai", "--out", str(out), "--web",
             "--web-port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = process.stderr.readline()
            assert first.strip() == f"Locust web UI: http://127.0.0.1:{port}", first
            # Locust's own stats see the streams (the run lasts a few seconds: 30 ms a token)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                stats = httpx.get(f"http://127.0.0.1:{port}/stats/requests", timeout=10).json()
                names = {(s["method"], s["name"]) for s in stats["stats"]}
                if ("stream", "short") in names or ("stream", "long") in names:
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"Locust's stats never showed a stream: {stats}")
            stdout, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
            process.wait()
    assert process.returncode == 1, stdout + stderr
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert (summary["completed"], summary["failed"]) == (10, 2)
    assert summary["errors"] == {"overloaded_error": 1, "cut": 1}
    assert summary["integrity"]["streams_failed"] == 2  # the dropped token and the cut stream
    assert summary["integrity"]["problems"]["lost"] == 1
    reasons = report["verdict"]["reasons"]
    assert len(reasons) == 2 and "--max-error-rate" in reasons[0] and "integrity" in reasons[1]
    assert "FAIL" in stdout


@pytest.mark.startup
def test_requests_past_the_drain_timeout_are_cancelled_and_fail_the_run(tmp_path):
    mix, keys = write_mix_and_keys(tmp_path)
    out = tmp_path / "out"
    with FakeServer(keys=KEYS, token_delay_s=1.0) as fake:  # 3-10 s a request
        result = loadtest("--url", fake.url, "--mix", mix, "--keys", keys, "--users", "2",
                          "--duration", "0.5s", "--drain-timeout", "1", "--out", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert (summary["requests"], summary["cancelled"], summary["completed"]) == (2, 2, 0)
    assert all(s["status"] == "cancelled" for s in report["samples"])
    assert "still running at the drain timeout" in report["verdict"]["reasons"][0]
    assert "still running at the drain timeout" in result.stdout  # printed after the plots
    assert all((out / name).stat().st_size > 5000 for name in PLOTS)  # drawn with no data too


@pytest.mark.startup
def test_ctrl_c_stops_the_run_and_still_reports(tmp_path):
    mix, keys = write_mix_and_keys(tmp_path)
    out = tmp_path / "out"
    with FakeServer(keys=KEYS, token_delay_s=1.0) as fake:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokstream", "loadtest", "--url", fake.url, "--mix", mix,
             "--keys", keys, "--users", "2", "--duration", "10m", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
        try:
            first = process.stderr.readline()  # the first progress line: the run is going
            assert " sent " in first, first
            deadline = time.monotonic() + 60
            while len(fake.requests) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
            process.wait()
    assert process.returncode == 130, stdout + stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["cancelled"] == 2 and report["summary"]["requests"] == 2


@pytest.mark.parametrize("args,message", [
    (["--mix", "nope"], "mix 'nope' not found"),
    (["--api", "grpc"], "--api"),
    (["--slo", "ttft=fast"], "--slo"),
    (["--duration", "0", "--requests", "0"], "no bound"),
    (["--arrival", "poisson", "--rate", "-2"], "--rate"),
    (["--keys", "/no/such/keys.toml"], "--keys"),
    (["--url", "http://127.0.0.1:{closed}"], "cannot reach the server"),
    (["--capacity-fraction", "-1"], "--capacity-fraction"),
    (["--capacity", "/no/such/capacity.json"], "--capacity"),  # chat states a fraction
    (["--probe-duration", "soon"], "--probe-duration"),
    (["--sweep", "--rate", "2"], "--sweep sets its own rates"),
    (["--sweep", "--duration", "0", "--requests", "0"], "no bound"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    from typer.testing import CliRunner

    from tokstream.cli import app

    args = [a.replace("{closed}", str(free_port())) for a in args]
    with FakeServer() as fake:
        # In this process: the command line is the same, without a Python start per case.
        result = CliRunner().invoke(app, ["loadtest", "--url", fake.url, "--out", str(tmp_path),
                                          "--requests", "1", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and result.exception.__class__ is SystemExit
    assert not fake.requests  # nothing was sent


def test_the_parent_process_never_imports_gevent_locust_or_torch():
    code = ("import sys; import tokstream.cli, tokstream.loadgen.runner, tokstream.loadgen.report,"
            " tokstream.loadgen.plots, tokstream.loadgen.tables, tokstream.loadgen.sweep, "
            "tokstream.loadgen.capacity, tokstream.loadgen.fairness; "
            "print(sorted(m for m in ('gevent', 'locust', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
