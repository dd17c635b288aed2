"""Speculative decoding through faults (issue 34 item 3), on dummy:tiny with real processes:
`tokstream chaos kill-rank` and `kill-engine --speculative ngram` pass the stream-history
checker; and on a `tokstream serve --tp 2 --speculative ngram` a rank or the engine core is
SIGKILLed while every stream is decoding with drafts accepted, and each resumed stream (greedy,
and seeded-sampled with rejected drafts too) equals a fault-free run with speculation off.

dummy:tiny's greedy output settles on one token, so its drafts are all accepted; sampled with
top_k 2 it repeats itself only now and then, so drafts are accepted and rejected (the
rollback of rejected positions is exercised). The draft counters are read before and after
the kill: a run that drafted nothing, or a kill outside speculation, fails here."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from helpers.chaos_report import resumed_after_fault
from helpers.serving import ROOT, ServerProcess, arecord
from tokstream.checker import check_streams

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

SERVE = ["--model", "dummy:tiny", "--tp", "2", "--step-timeout", "10",
         "--max-num-batched-tokens", "32", "--no-prefix-caching"]
COPY = [5, 17, 99, 3, 42, 8] * 4
"""A prompt that repeats itself: its drafts start at the first decode."""


def completion(prompt: list[int], max_tokens: int, **sampling) -> dict:
    return {"model": "dummy:tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, **sampling}


WORKLOAD = [
    completion(COPY, 160, temperature=0),
    completion([7, 7, *COPY], 160, temperature=0),
    completion(COPY, 64, temperature=1.0, top_k=2, seed=5),
    completion([11, *COPY], 64, temperature=1.0, top_k=2, seed=9),
]
"""Greedy and seeded: each must equal the fault-free run. The greedy ones are longer, so all
four are still decoding when the sampled ones (about 1.3 tokens a step) have drafts
accepted."""


def spec_counts(server) -> dict:
    return server.state()["speculation"]


def run(server, fault=None) -> list[list[int]]:
    """The workload's streams at once, fault(client) alongside; each checked whole."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            streams = [asyncio.ensure_future(arecord(client, "/v1/completions", body))
                       for body in WORKLOAD]
            if fault is not None:
                await fault(client)
            return await asyncio.gather(*streams)

    report = check_streams(asyncio.run(main()))
    assert report.ok, report.summary()
    assert report.statuses == {"complete": len(WORKLOAD), "failed": 0, "cut": 0}
    assert [len(s.token_ids) for s in report.streams] == [b["max_tokens"] for b in WORKLOAD]
    return [s.token_ids for s in report.streams]


async def all_drafting(client) -> dict:
    """The first /v1/state in which every stream of the workload is decoding, short of its
    end, with drafts of it accepted: the moment to kill."""
    deadline = time.monotonic() + 60
    while True:
        state = (await client.get("/v1/state")).json()
        rows = state["requests"]
        if len(rows) == len(WORKLOAD) and all(
                r["phase"] == "decode" and (r.get("accepted_tokens") or 0) > 0
                and r["output_tokens"] < r["max_tokens"] - 8 for r in rows):
            return state
        assert time.monotonic() < deadline, json.dumps(state)[:2000]
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def plain():
    """The fault-free run with speculation off."""
    with ServerProcess(*SERVE, "--speculative", "off") as server:
        assert spec_counts(server)["method"] == "off"
        return run(server)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*SERVE, "--speculative", "ngram") as server:
        yield server


def settled(server, restarts: int) -> dict:
    """Idle, every block free (the per-step self-check clean), ready, `restarts` in all."""
    state = server.wait_idle(timeout=60)
    assert state["replica"]["status"] == "ready"
    assert state["replica"]["restarts"] == restarts, state["replica"]
    assert httpx.get(server.url + "/health").status_code == 200
    return state


def test_rank_killed_while_drafting_resumes_as_plain_decoding(server, plain):
    before = server.state()
    at_kill = {}

    async def fault(client):
        state = await all_drafting(client)
        at_kill.update(state["speculation"], rows=state["requests"])
        os.kill(state["ranks"][1]["pid"], signal.SIGKILL)

    assert run(server, fault) == plain
    after = settled(server, before["replica"]["restarts"] + 1)
    assert any(e["kind"] == "rank_failure" for e in after["events"])
    # The same core counts on: drafts were accepted and rejected before the kill (the
    # sampled streams') and accepted again after it.
    spec = after["speculation"]
    assert 0 < at_kill["num_accepted_tokens"] < at_kill["num_draft_tokens"], at_kill
    assert spec["num_accepted_tokens"] > at_kill["num_accepted_tokens"], (at_kill, spec)


def test_engine_core_killed_while_drafting_resumes_as_plain_decoding(server, plain):
    before = server.state()
    at_kill = {}

    async def fault(client):
        state = await all_drafting(client)
        at_kill.update(state["speculation"])
        os.kill(state["engine"]["pid"], signal.SIGKILL)

    assert run(server, fault) == plain
    after = settled(server, before["replica"]["restarts"] + 1)
    assert after["engine"]["pid"] != before["engine"]["pid"]
    assert after["replica"]["resumed_requests"]["core"] >= \
        before["replica"]["resumed_requests"]["core"] + len(WORKLOAD)
    # The new core counts from zero: all it accepted, it accepted after the kill.
    assert at_kill["num_accepted_tokens"] > 0
    assert after["speculation"]["num_accepted_tokens"] > 0, after["speculation"]


def chaos(tmp_path, *args) -> dict:
    path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "tokstream", "chaos", *args,
                             "--model", "dummy:tiny", "--speculative", "ngram",
                             "--max-tokens", "24", "--json", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    report = json.loads(path.read_text())
    assert report["ok"] and not any(report["violations"].values()), report["violation_details"]
    assert "--speculative ngram" in report["target"]["command"]
    return report


@pytest.mark.parametrize("experiment", [["kill-rank", "0"], ["kill-engine"]],
                         ids=lambda e: e[0])
def test_chaos_with_speculation_passes_the_checker(tmp_path, experiment):
    report = chaos(tmp_path, *experiment)
    fault, = report["faults"]
    assert report["classes"] == {"complete": len(report["streams"])}
    assert resumed_after_fault(report, fault)
    spec = report["speculation"]
    assert spec["after_reference"]["num_accepted_tokens"] > 0, spec
    accepted = spec["after_rounds"][0]["num_accepted_tokens"]
    if experiment[0] == "kill-rank":  # the same core: what the round added
        assert accepted > spec["after_reference"]["num_accepted_tokens"], spec
    else:  # a new core: all it accepted came after the kill
        assert accepted > 0, spec
