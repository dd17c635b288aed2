"""SIGTERM drains: readiness turns 503 and new requests are refused with retry-after, while
every open stream runs to its end; past --shutdown-timeout the rest end with an error event,
never cut; the same when the signal reaches the whole process group (the engine core and
ranks are stopped by the gateway, never restarted)."""

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from helpers.serving import ServerProcess, anthropic_body, openai_body, record
from tokstream.checker import check_streams
from tokstream.process_end import wait_ended

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]

# Long enough that the streams are still running well after the signal (dummy:tiny with the
# ci profile's 32-token budget streams a few hundred tokens a second on 2 loaded cores).
MAX_TOKENS = 1800
SERVE = ("--profile", "ci", "--num-blocks", "2048", "--max-num-batched-tokens", "32")
# However slow the machine, the streams end before the shutdown timeout in these tests.
DRAINING = (*SERVE, "--shutdown-timeout", "600")


def open_streams(server, n):
    results: dict[int, tuple] = {}

    def one(i):
        with httpx.Client(base_url=server.url, timeout=120) as client:
            results[i] = record(client, "/v1/messages", anthropic_body(
                f"stream {i}", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while True:
        rows = server.state()["requests"]
        if len(rows) == n and all(r["output_tokens"] >= 5 for r in rows):
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.05)
    return results, threads


def finish(threads, results, n):
    for thread in threads:
        thread.join(120)
    return check_streams([results[i][1] for i in range(n)]).streams


def until_not_ready(server):
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health/ready", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def server_tree(server):
    root = psutil.Process(server.process.pid)
    return [root, *root.children(recursive=True)]


def test_sigterm_lets_every_open_stream_run_to_its_end():
    with ServerProcess(*DRAINING) as server:
        for path in ("/health", "/health/live", "/health/ready"):
            response = httpx.get(server.url + path, timeout=5)
            assert response.status_code == 200 and response.json()["status"] == "ready", path
        results, threads = open_streams(server, 3)
        tree = server_tree(server)
        server.process.send_signal(signal.SIGTERM)
        until_not_ready(server)
        assert httpx.get(server.url + "/health/live", timeout=5).status_code == 200
        refused = httpx.post(server.url + "/v1/messages", json=anthropic_body(stream=False),
                             timeout=10)
        assert refused.status_code == 529 and refused.headers["retry-after"], refused.text
        refused = httpx.post(server.url + "/v1/chat/completions", json=openai_body(),
                             timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        streams = finish(threads, results, 3)
        assert server.process.wait(60) is not None
    for stream in streams:
        assert stream.status == "complete" and stream.ok, stream.problems
        assert len(stream.token_ids) == MAX_TOKENS
    log = "".join(server.log)
    assert "starting another" not in log and "CancelledError" not in log, log[-3000:]
    alive = wait_ended(tree, 30)
    assert not alive, alive


def test_past_the_shutdown_timeout_a_stream_ends_with_an_error_event():
    with ServerProcess(*SERVE, "--shutdown-timeout", "0") as server:
        results, threads = open_streams(server, 2)
        server.process.send_signal(signal.SIGTERM)
        streams = finish(threads, results, 2)
        assert server.process.wait(60) is not None
    for stream in streams:
        assert stream.status == "failed" and stream.ok, (stream.status, stream.problems)
        assert stream.error["type"] == "overloaded_error"
        assert "shutting down" in stream.error["message"]


def test_sigterm_to_the_whole_process_group_drains_the_same():
    """systemd's default (kill -TERM -PGID): the engine core and ranks get it too."""
    with ServerProcess(*DRAINING, new_session=True) as server:
        results, threads = open_streams(server, 2)
        tree = server_tree(server)
        os.killpg(server.process.pid, signal.SIGTERM)
        streams = finish(threads, results, 2)
        assert server.process.wait(60) is not None
    for stream in streams:
        assert stream.status == "complete" and stream.ok, (stream.status, stream.problems)
        assert len(stream.token_ids) == MAX_TOKENS
    log = "".join(server.log)
    assert "died" not in log and "starting another" not in log, log[-3000:]
    alive = wait_ended(tree, 30)
    assert not alive, alive
