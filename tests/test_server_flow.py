"""Flow control on a real server: a slow client never stalls the batch (counted in engine
steps, never timed) and is cancelled past its limit; a client that disconnects is aborted and
its blocks freed; admission refuses past its bounds with 529/503 and retry-after; an idle
stream gets pings."""

import asyncio
import json
import time

import httpx
import pytest

from chaos.rounds import steps_skipped
from helpers.serving import (INTEGRITY, ServerProcess, anthropic_body, arecord, dechunk, raw_request, read_all,
                     record)
from tokstream.checker import check_streams, parse_sse

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server():
    # A small pending limit so a non-reading client is cancelled as soon as its socket fills,
    # and a smaller send buffer so that it fills sooner (cancelled at ~410 tokens, not ~630:
    # measured). It still holds hundreds of events, far more than a reading client lags.
    with ServerProcess("--profile", "ci", "--max-pending-tokens", "32",
                       "--slow-client-grace", "240", "--send-buffer-bytes", "16384") as server:
        yield server


def _wait_for(predicate, server, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        state = server.state()
        if predicate(state):
            return state
        assert time.monotonic() < deadline, json.dumps(state)[:2000]
        time.sleep(0.05)


def test_slow_client_never_stalls_the_batch_and_is_cancelled(server):
    host, port = server.host_port
    # A client with a tiny receive window that reads nothing while the others stream.
    slow = raw_request(host, port, "/v1/messages",
                       anthropic_body("slow", max_tokens=1200, ignore_eos=True), rcvbuf=2048)
    try:
        _wait_for(lambda s: any(r["output_tokens"] > 0 for r in s["requests"]), server)

        async def fast_streams():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(arecord(client, "/v1/messages", anthropic_body(
                    f"fast {i}", max_tokens=150, ignore_eos=True)) for i in range(4)))

        streams = asyncio.run(fast_streams())
        report = check_streams(streams)
        assert report.ok, report.summary()
        for stream in streams:
            steps = [s for e in stream.events if e.event == "content_block_delta"
                     for s in e.json()["tokstream"]["step_ids"]]
            assert len(steps) == 150
            # A token on every engine step from the first decode on (several on a step that
            # accepted drafts): the batch never waited for the slow client.
            assert not steps_skipped(steps[1:]), steps
        # Cancelled in the engine (its blocks are free) while the gateway still holds the
        # connection for the client to read the rest.
        state = _wait_for(lambda s: s["batch"]["running"] == 0 and s["kv"]["used_blocks"] == 0
                          and [r["cancelled"] for r in s["requests"]] == ["slow_client"], server)
        cancelled = [e for e in state["events"] if e["kind"] == "cancelled"]
        assert [e["reason"] for e in cancelled] == ["slow_client"]
        # Reading now, the slow client gets what was pending, then an explicit error event.
        events = parse_sse(dechunk(read_all(slow)))
    finally:
        slow.close()
    slow_report = check_streams([type(streams[0])(events)])
    stream = slow_report.streams[0]
    assert stream.status == "failed", slow_report.summary()
    assert stream.error["type"] == "overloaded_error" and "too slow" in stream.error["message"]
    assert not [p for p in stream.problems if p[0] in ("duplicated", "reordered", "foreign")]
    assert 0 < len(stream.token_ids) < 1200


def test_disconnect_aborts_and_frees_blocks(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=INTEGRITY) as client:
        with client.stream("POST", "/v1/messages", json=anthropic_body(
                "leaving", max_tokens=1900, ignore_eos=True)) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            for line in lines:
                if line.startswith("id: 5"):
                    break
            state = server.state()
            assert state["kv"]["used_blocks"] > 0 and len(state["requests"]) == 1
        # Closed mid-stream: the request is aborted in the engine and its blocks come back.
        state = server.wait_idle(timeout=60)
        assert state["kv"]["free_blocks"] == state["kv"]["num_blocks"]
        assert any(e["kind"] == "cancelled" and e["reason"] == "disconnected"
                   for e in state["events"])

        # The same for a non-streaming request whose caller goes away.
        host, port = server.host_port
        sock = raw_request(host, port, "/v1/chat/completions", {
            "model": "dummy:tiny", "max_tokens": 1900, "ignore_eos": True,
            "messages": [{"role": "user", "content": "never mind"}]})
        _wait_for(lambda s: len(s["requests"]) == 1, server)
        sock.close()
        server.wait_idle(timeout=60)
        # And the server still serves.
        _, stream = record(client, "/v1/messages", anthropic_body(max_tokens=4))
        assert check_streams([stream]).ok


def test_admission_refuses_with_retry_after_and_idle_streams_get_pings():
    args = ("--profile", "ci", "--max-num-seqs", "1", "--max-waiting-requests", "2",
            "--max-waiting-tokens", "100", "--ping-interval", "0.2")
    with ServerProcess(*args) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as aclient:
                long = anthropic_body("running", max_tokens=1200, ignore_eos=True)
                running = asyncio.ensure_future(arecord(aclient, "/v1/messages", long))
                await asyncio.to_thread(_wait_for, lambda s: s["batch"]["running"] == 1, server)
                queued = [asyncio.ensure_future(arecord(aclient, "/v1/messages", anthropic_body(
                    f"queued {i}", max_tokens=4))) for i in range(2)]
                await asyncio.to_thread(_wait_for, lambda s: s["admission"]["waiting_requests"]
                                        == 2, server)
                refused = await aclient.post("/v1/messages", json=anthropic_body(max_tokens=4))
                refused_openai = await aclient.post("/v1/chat/completions", json={
                    "model": "dummy:tiny", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "x"}]})
                await asyncio.sleep(0.6)  # queued streams sit idle: pings keep them open
                state = await asyncio.to_thread(server.state)
                assert not any(stream.done() for stream in queued)
                running.cancel()  # its caller leaves: the queued requests run
                results = await asyncio.gather(*queued)
                return refused, refused_openai, state, results

        refused, refused_openai, state, results = asyncio.run(scenario())
        assert refused.status_code == 529
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused_openai.status_code == 503
        assert refused_openai.json()["error"]["type"] == "overloaded_error"
        assert int(refused_openai.headers["retry-after"]) >= 1
        assert any(e["kind"] == "refused" for e in state["events"])
        report = check_streams(list(results))
        assert report.ok, report.summary()
        for queued in results:
            names = [e.event for e in queued.events]
            first_token = names.index("content_block_delta")
            assert names[3:first_token].count("ping") >= 2, names[:10]

        # A prompt that would pass the waiting-token bound is refused too.
        async def by_tokens():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as aclient:
                long = anthropic_body("running", max_tokens=1200, ignore_eos=True)
                running = asyncio.ensure_future(arecord(aclient, "/v1/messages", long))
                await asyncio.to_thread(_wait_for, lambda s: s["batch"]["running"] == 1,
                                        server)
                big = anthropic_body("w " * 30, max_tokens=4)
                queued = asyncio.ensure_future(arecord(aclient, "/v1/messages", big))
                await asyncio.to_thread(_wait_for, lambda s: s["admission"]["waiting_requests"]
                                        == 1, server)
                refused = await aclient.post("/v1/messages", json=big)
                running.cancel()
                await queued
                return refused

        refused = asyncio.run(by_tokens())
        assert refused.status_code == 529
        assert "prompt tokens" in refused.json()["error"]["message"]
        server.wait_idle()
        _, stream = record(client, "/v1/messages", anthropic_body(max_tokens=4))
        assert check_streams([stream]).ok


# Engine-core death (restarted, streams resumed; down only when restarts keep failing) is
# tested in test_serve_recovery.py.
