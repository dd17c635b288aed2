"""A request that breaks the replica at every step (TOKSTREAM_POISON: its token kills rank 0
whenever a step carries it), in process on dummy:tiny: it is ended with an error after
max_request_failures failures in a row, the replica recovers without it, and the requests
that shared its steps finish with exactly their fault-free tokens."""

import threading
import time

import httpx
import pytest

from helpers.serving import ServerProcess, anthropic_body, record
from tokstream.checker import check_streams
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.errors import ErrorKind
from test_recovery import GREEDY, PROMPTS, config

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]

POISON_TOKEN = 77
POISON = [POISON_TOKEN, 5, 17, 9, 9]
LONGER_THAN_A_STEP = "tell me a story about the sea, please"
"""55 prompt tokens on dummy:tiny, against the server test's 32-token step budget."""


def run(llm, requests, max_restarts=6):
    tokens = {r.request_id: [] for r in requests}
    ends = {}
    for request in requests:
        llm.core.add_request(request)
    while llm.core.has_work:
        for delta in llm.core.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                ends[delta.request_id] = (delta.finish_reason, delta.error, delta.error_kind)
        assert llm.core.recovery.restarts <= max_restarts, "the replica keeps restarting"
        assert llm.core.scheduler.check() == []
    return tokens, ends


def test_a_request_that_breaks_every_step_is_ended_and_the_others_go_on(monkeypatch):
    innocent = [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4])]
    with LLM(config(tp=1)) as llm:
        reference, _ = run(llm, innocent)
    monkeypatch.setenv("TOKSTREAM_POISON", f"rank:{POISON_TOKEN}")
    requests = [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4])]
    requests.insert(2, EngineRequest("poison", POISON, GREEDY))
    with LLM(config(tp=1)) as llm:
        tokens, ends = run(llm, requests)
        core = llm.core
        assert core.recovery.restarts == 3 and core.status == "ready"
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
        failed = [e for e in core.events if e["kind"] == "request_failed"]
    reason, error, kind = ends.pop("poison")
    assert reason == "error" and "3 failures in a row" in error, error
    assert kind == ErrorKind.USER  # an api_error: this request's own fault
    assert [e["request_id"] for e in failed] == ["poison"]
    assert all(end == ("length", None, None) for end in ends.values()), ends
    assert {rid: t for rid, t in tokens.items() if rid != "poison"} == reference


def test_a_resubmitted_request_stays_a_suspect_until_it_gets_a_token(monkeypatch):
    """As the gateway resubmits them after two core deaths: a stream whose re-prefill takes
    several steps, and the poison request, each with 2 failures in a row behind it. The
    stream must get a token before the poison request may share a step with it (the gateway
    charges a death to every request that got no token since its last one)."""
    monkeypatch.setenv("TOKSTREAM_POISON", f"rank:{POISON_TOKEN}")
    long_prompt = PROMPTS[5] * 2  # 56 tokens: three chunks of the 24-token budget
    normal = EngineRequest("normal", long_prompt, GREEDY, num_failures=2)
    poison = EngineRequest("poison", POISON, GREEDY, num_failures=2)
    with LLM(config(tp=1)) as llm:
        core = llm.core
        core.add_request(normal)
        core.add_request(poison)
        tokens_at_failure = None
        tokens = 0
        while core.has_work:
            for delta in core.step():
                if delta.request_id == "normal":
                    tokens += len(delta.token_ids)
            if core.recovery.restarts and tokens_at_failure is None:
                tokens_at_failure = tokens
            assert core.recovery.restarts <= 1
    assert core.recovery.restarts == 1
    assert tokens_at_failure >= 1
    assert tokens == GREEDY.max_tokens


def test_a_request_that_kills_the_engine_core_every_time_is_ended_by_the_gateway():
    """Through the server: the poison token kills the engine core itself at every step that
    carries it. The gateway ends that request after 3 core deaths in a row (its count goes
    with it to each new core, which runs it alone on its last chance), and a stream that was
    decoding alongside it completes. That stream's prompt is longer than the step budget, so
    each new core re-prefills it over several steps before its next token: it must not share
    a step with the poison request before that token (it would be charged the death too)."""
    # Speculation off: the streams must still be decoding, a token a step, across the deaths.
    with ServerProcess("--profile", "ci", "--max-num-batched-tokens", "32", "--speculative", "off",
                       env={"TOKSTREAM_POISON": f"core:{POISON_TOKEN}"}) as server:
        client = httpx.Client(base_url=server.url, timeout=120)
        results = {}
        normal = threading.Thread(target=lambda: results.setdefault("normal", record(
            client, "/v1/messages", anthropic_body(LONGER_THAN_A_STEP, max_tokens=400,
                                                   temperature=0, ignore_eos=True))))
        normal.start()
        deadline = time.monotonic() + 60
        while not any(r["output_tokens"] for r in server.state()["requests"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        poison = threading.Thread(target=lambda: results.setdefault("poison", record(
            client, "/v1/completions", {"model": "dummy:tiny", "prompt": POISON,
                                        "max_tokens": 8, "stream": True})))
        poison.start()
        while poison.is_alive() or normal.is_alive():
            restarts = server.state()["replica"]["restarts_by_kind"]["core"]
            assert restarts <= 5, "the engine core keeps being restarted"
            time.sleep(0.2)
        report = check_streams([results["normal"][1], results["poison"][1]])
        normal_report, poison_report = report.streams
        assert normal_report.status == "complete" and normal_report.ok, normal_report
        assert len(normal_report.token_ids) == 400
        assert poison_report.status == "failed", poison_report
        assert poison_report.error["type"] == "api_error", poison_report.error
        assert "3 failures in a row" in poison_report.error["message"]
        state = server.wait_idle()
        assert state["replica"]["status"] == "ready"
        assert state["replica"]["restarts_by_kind"]["core"] == 3
        client.close()
