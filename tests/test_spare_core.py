"""Warm spares (serve --spare --spare-core): an engine-core death swaps in the gateway's
standby core; the standbys (the new core's rank group, the next spare core) load only once
the resumed streams have their next token, so their loading never competes with the
re-prefill."""

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from helpers.serving import ServerProcess, anthropic_body, record
from test_recovery import GREEDY, PROMPTS, config
from tokstream.checker import check_streams
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.process_end import wait_ended

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]


def events(server, kind: str) -> list[dict]:
    return [e for e in server.state()["events"] if e["kind"] == kind]


def wait_for(predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return found


def ranks_under(pid: int) -> list[psutil.Process]:
    """The rank processes under an engine core (children of its forkserver)."""
    return [p for child in psutil.Process(pid).children()
            if "forkserver" in " ".join(child.cmdline()) for p in child.children()]


MAX_TOKENS = 1500


def test_an_engine_core_death_swaps_in_the_spare_core():
    with ServerProcess("--profile", "ci", "--spare", "--spare-core") as server:
        spare = wait_for(lambda: events(server, "spare_core_ready"))[0]
        first = server.state()["engine"]["pid"]
        assert spare["pid"] != first
        client = httpx.Client(base_url=server.url, timeout=120)
        result = {}
        # Long enough to be caught mid-stream: warm (after other tests), dummy:tiny streams
        # 64 tokens in less time than one /v1/state poll, and the wait below never saw them.
        stream = threading.Thread(target=lambda: result.setdefault("s", record(
            client, "/v1/messages", anthropic_body("hello", max_tokens=MAX_TOKENS,
                                                   temperature=0, ignore_eos=True))))
        stream.start()
        wait_for(lambda: any(r["output_tokens"] >= 4 for r in server.state()["requests"]))
        os.kill(first, signal.SIGKILL)
        restarted = wait_for(lambda: events(server, "engine_restarted"))[0]
        assert restarted["pid"] == spare["pid"] and restarted["spare"], restarted
        stream.join(120)
        report = check_streams([result["s"][1]]).streams[0]
        assert report.status == "complete" and report.ok, report
        assert len(report.token_ids) == MAX_TOKENS
        # After the resumed stream's next token: the new core arms a standby rank group of
        # its own, and the next spare core loads.
        second = wait_for(lambda: events(server, "spare_core_ready")[1:])[0]
        assert second["pid"] not in (first, spare["pid"])
        assert len(wait_for(lambda: len(ranks_under(spare["pid"])) == 2
                            and ranks_under(spare["pid"]))) == 2
        tree = psutil.Process(server.process.pid).children(recursive=True)
        server.wait_idle()
        client.close()
    alive = wait_ended(tree, 30)
    assert not alive, alive


def test_the_standby_group_reloads_once_the_resumed_requests_have_a_token():
    with LLM(config(tp=1, spare=True)) as llm:
        core = llm.core
        # Not the environment of an engine that started this process's forkserver earlier
        # (after test_triton_model's, the ranks ran Triton's interpreter: 20x slower).
        assert core.executor.ready.kernels == "torch"
        core.add_request(EngineRequest("r", PROMPTS[2], GREEDY))
        tokens = 0
        while tokens < 3:
            tokens += sum(len(d.token_ids) for d in core.step())
        os.kill(core.executor.pids[0], signal.SIGKILL)
        while not core.recovery.restarts:
            tokens += sum(len(d.token_ids) for d in core.step())
        assert core.executor.spare is None  # not while the request waits for its re-prefill
        before = tokens
        while tokens == before:
            tokens += sum(len(d.token_ids) for d in core.step())
        core.step()
        assert core.executor.spare is not None
