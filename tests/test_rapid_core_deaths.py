"""Engine cores that keep dying with no request to blame (issue 31): each replacement is
SIGKILLed right after it serves again. A request is charged only for the deaths of steps it
was in, and suspects are given to a new core only once the others have a token from it and
the core has kept running a grace after, so no stream is ended as a poison request: every one
completes. Past RAPID_DEATHS_LIMIT such deaths in a row the replica is down (every live
stream ends with an overloaded_error naming the cause), and a later try brings it back."""

import os
import signal
import threading
import time

import httpx
import pytest

from helpers.serving import ServerProcess, anthropic_body, record
from tokstream.checker import check_streams
from tokstream.server.replica.recovery import RAPID_DEATHS_LIMIT

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

PROMPTS = ["tell me a story about the sea, please", "what is a lighthouse keeper for",
           "count the prime numbers below one hundred", "describe a city at night for me"]
"""Longer than the 32-token step budget with their outputs: a new core re-prefills them
over several steps (no prefix cache: no block is adopted), so its first token comes to
one stream while the others still wait."""


def wait_for(predicate, timeout=120, what=""):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return found


def tokens(state) -> int:
    return sum(r["output_tokens"] for r in state["requests"])


def kill_cores_as_they_serve(server, deaths: int) -> list[int]:
    """SIGKILL the engine core once the streams decode, then each replacement right after
    it has served a token; returns the pids killed."""
    killed = []
    wait_for(lambda: len(server.state()["requests"]) == len(PROMPTS)
             and all(r["output_tokens"] >= 2 for r in server.state()["requests"]),
             what="the streams never decoded")
    for _ in range(deaths):
        state = wait_for(lambda: (s := server.state())["engine"]["pid"] not in killed
                         and s["engine"]["alive"] and s, what="no new core")
        before = tokens(state)
        wait_for(lambda: tokens(server.state()) > before or server.state()["replica"][
            "status"] == "down", what="the new core never served")
        if server.state()["replica"]["status"] == "down":
            break
        pid = state["engine"]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    return killed


def start_streams(server, client, results, max_tokens=300):
    threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, record(
        client, "/v1/messages", anthropic_body(p, max_tokens=max_tokens, temperature=0,
                                               ignore_eos=True))))
               for i, p in enumerate(PROMPTS)]
    for thread in threads:
        thread.start()
    return threads


SERVE = ("--profile", "ci", "--max-num-batched-tokens", "32", "--no-prefix-caching",
         "--down-retry-interval", "1", "--speculative", "off")
"""Speculation off: dummy:tiny's drafts are all accepted, and the streams would end before the
cores are killed (speculation through faults: test_speculative_faults.py)."""


def test_three_quick_core_deaths_blame_no_request():
    with ServerProcess(*SERVE) as server:
        client = httpx.Client(base_url=server.url, timeout=120)
        results = {}
        # Long enough that no stream ends before the third death even when the test polls
        # slowly (a full suite run): with 300 tokens all four once finished between two polls
        # of a new core, which then served nothing the test could see.
        threads = start_streams(server, client, results, max_tokens=1500)
        killed = kill_cores_as_they_serve(server, 3)
        for thread in threads:
            thread.join(180)
        assert len(killed) == 3
        report = check_streams([results[i][1] for i in range(len(PROMPTS))])
        assert report.ok, report.summary()
        for stream in report.streams:
            assert stream.status == "complete", (stream.status, stream.error)
            assert len(stream.token_ids) == 1500
        state = server.wait_idle()
        assert state["replica"]["restarts_by_kind"]["core"] == 3
        assert state["replica"]["status"] == "ready"
        assert not [e for e in state["events"] if e["kind"] == "request_failed"]
        client.close()


def test_past_the_replica_limit_it_is_down_with_an_overloaded_error_then_back():
    with ServerProcess(*SERVE) as server:
        client = httpx.Client(base_url=server.url, timeout=120)
        results = {}
        threads = start_streams(server, client, results, max_tokens=1500)
        killed = kill_cores_as_they_serve(server, RAPID_DEATHS_LIMIT)
        for thread in threads:
            thread.join(180)
        assert len(killed) == RAPID_DEATHS_LIMIT
        report = check_streams([results[i][1] for i in range(len(PROMPTS))])
        assert report.ok, report.summary()  # nothing lost or repeated before the error
        for stream in report.streams:
            assert stream.status == "failed", stream.status
            assert stream.error["type"] == "overloaded_error", stream.error
            assert "replica down" in stream.error["message"]
            assert "no request to blame" in stream.error["message"]
        # Ended by the replica's limit, none as a poison request (those carry a count).
        assert not [e for e in server.state()["events"]
                    if e["kind"] == "request_failed" and "failures" in e]
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200,
                 what="the replica never came back")
        response, stream = record(client, "/v1/messages", anthropic_body("again", max_tokens=8))
        assert response.status_code == 200
        assert check_streams([stream]).streams[0].status == "complete"
        client.close()
