"""An engine-core death keeps the KV pool: the gateway holds the pool files, and the core that
takes over adopts every block the dead one had listed as a cached prefix (pool_adoption), so
a resumed stream re-prefills only its unfinished block and gives the same tokens as a run
without the fault. The hand-over waits for every other process to let go of the pool."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers.serving import ServerProcess, openai_body, record
from tokstream.checker import check_streams
from tokstream.engine.messages.gateway import PoolAdopted
from tokstream.engine.recovery.pool_files import PoolFiles
from tokstream.errors import ReplicaError
from tokstream.server.replica import kept_pool
from tokstream.server.access.tenants import hash_key

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]

ALICE, BOB, ADMIN = "sk-alice-kept-kv", "sk-bob-kept-kv", "sk-admin-kept-kv"
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
PROMPT = " ".join(f"word{i}" for i in range(150))
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Two tenants: their prefix caches are salted apart, so the faulted run finds none of the
    # reference run's blocks, only its own. Small steps: the stream is still decoding when
    # the core is killed.
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(f'admin_key_sha256 = "{hash_key(ADMIN)}"\n' + "".join(
        f'[[tenant]]\nname = "{name}"\nkey_sha256 = "{hash_key(key)}"\n'
        for name, key in (("alice", ALICE), ("bob", BOB))))
    with ServerProcess("--profile", "ci", "--tenants", str(tenants), "--tp", "2",
                       "--num-blocks", "2048", "--max-num-batched-tokens", "32") as server:
        yield server


def events(server, kind: str) -> list[dict]:
    return [e for e in server.state(**AS_ADMIN)["events"]
            if e["kind"] == kind]


def stream(client, key: str) -> tuple[list[int], list[float]]:
    """A greedy stream's tokens and their logprobs: a token of a tiny random model can
    survive a wrong context, its logprob cannot."""
    body = openai_body(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                       logprobs=True)
    _, recorded = record(client, "/v1/chat/completions", body,
                         {"authorization": f"Bearer {key}"})
    report = check_streams([recorded]).streams[0]
    assert report.status == "complete" and report.ok, report
    logprobs = [entry["logprob"] for event in recorded.events if event.data != "[DONE]"
                for choice in event.json().get("choices", [])
                for entry in (choice.get("logprobs") or {}).get("content") or []]
    assert len(logprobs) == len(report.token_ids) == MAX_TOKENS
    return report.token_ids, logprobs


def test_an_engine_core_death_keeps_the_cached_blocks(server):
    client = httpx.Client(base_url=server.url, timeout=120)
    reference, reference_logprobs = stream(client, BOB)
    state = server.state(**AS_ADMIN)
    core_pid, block_size = state["engine"]["pid"], state["kv"]["block_size"]
    result = {}
    faulted = threading.Thread(target=lambda: result.setdefault("out", stream(client, ALICE)))
    faulted.start()
    deadline = time.monotonic() + 60
    while not any(r["output_tokens"] >= 40 for r in
                  server.state(**AS_ADMIN)["requests"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(core_pid, signal.SIGKILL)
    faulted.join(120)
    tokens, logprobs = result["out"]
    # The kept KV is the KV this stream computed.
    assert tokens == reference
    # Bit for bit in practice; 7 blocks of 1,100 tokens read from the wrong place moved them
    # by up to 9e-4 (a mutation), a zeroed pool moved 552 of 600.
    assert logprobs == pytest.approx(reference_logprobs, abs=1e-5)
    restarted = events(server, "engine_restarted")[-1]
    # At least the prompt's and forty tokens' full blocks were kept (and the reference run's:
    # nothing held them, so they were still listed).
    assert restarted["kv_refused"] is None, restarted
    assert restarted["kv_blocks_kept"] * block_size >= 150 + 40, restarted
    after = server.wait_idle(**AS_ADMIN)
    # The new core found the faulted stream's blocks by prefix: it re-prefilled less than a
    # block of what the stream had before the fault.
    assert after["kv"]["prefix_cache_hits"] >= 150 + 40 - block_size, after["kv"]
    client.close()


# --- the hand-over's wait -----------------------------------------------------------------

class FakeEngine:
    """What hand_over reads of an AsyncEngine: its pool, its pid, adopt_pool."""

    def __init__(self, pool):
        self.pool = pool
        self.pid = os.getpid()  # its own tree: this test process and its children
        self.adopted_at = None

    async def adopt_pool(self):
        self.adopted_at = time.monotonic()
        return PoolAdopted(0, 7)


def outsider(path: str) -> subprocess.Popen:
    """Another process mapping the pool file at path (a dead core's rank, still running)."""
    code = ("import mmap, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
            "os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); print('mapped', flush=True); "
            "time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE,
                               start_new_session=True)  # not under this test's own tree
    assert process.stdout.readline().strip() == b"mapped"
    return process


def test_the_hand_over_waits_for_other_processes_to_let_go_of_the_pool(monkeypatch):
    pool = PoolFiles(tp=1)
    try:
        engine = FakeEngine(pool)
        other = outsider(pool.paths().ranks[0])
        monkeypatch.setattr(kept_pool, "own_tree", lambda engine: set())  # the outsider too
        killed_at = {}

        async def scenario():
            async def kill_later():
                await asyncio.sleep(0.5)
                other.kill()
                killed_at["t"] = time.monotonic()
            killer = asyncio.create_task(kill_later())
            reply = await kept_pool.hand_over(engine)
            await killer
            return reply

        assert asyncio.run(scenario()) == {"blocks": 7, "refused": None}
        assert engine.adopted_at > killed_at["t"]
        other.wait()
    finally:
        pool.close()


def test_a_process_that_keeps_the_pool_costs_the_kept_blocks(monkeypatch):
    pool = PoolFiles(tp=1)
    other = outsider(pool.paths().index)
    try:
        engine = FakeEngine(pool)
        monkeypatch.setattr(kept_pool, "own_tree", lambda engine: set())
        monkeypatch.setattr(kept_pool, "HAND_OVER_WAIT_S", 0.3)
        reply = asyncio.run(kept_pool.hand_over(engine))
        assert reply["blocks"] == 0 and str(other.pid) in reply["refused"]
        assert engine.adopted_at is None
    finally:
        other.kill()
        other.wait()
        pool.close()


def test_a_core_that_dies_in_the_hand_over_is_no_error_of_the_hand_over():
    pool = PoolFiles(tp=1)
    try:
        engine = FakeEngine(pool)

        async def dead():
            raise ReplicaError("engine is down: engine core process exited")
        engine.adopt_pool = dead
        reply = asyncio.run(kept_pool.hand_over(engine))
        assert reply == {"blocks": 0, "refused": "engine is down: engine core process exited"}
    finally:
        pool.close()
