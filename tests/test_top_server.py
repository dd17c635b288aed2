"""`tokstream top` against a real `tokstream serve` (dummy:tiny, a tenants file with an admin
key): what /v1/state now carries for it (cached-block runs, per-request phase, per-process CPU),
and the app itself following live streams, opening one, refusing a missing admin key, and
showing "disconnected — retrying" once the server is gone."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from helpers.serving import ServerProcess, anthropic_body
from tokstream.core_state import Kv
from tokstream.server.access.tenants import hash_key
from tokstream.top.app import TopApp
from tokstream.top.detail import DetailScreen
from tokstream.top.kv_map import blocks
from tokstream.top.source import HttpSource
from tokstream.top.tables import RequestsTable

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]

ALICE, ADMIN = "sk-alice-top-test", "sk-admin-top-test"
SYSTEM = "Shared instructions that fill several KV blocks for every request. " * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(f'admin_key_sha256 = "{hash_key(ADMIN)}"\n\n[[tenant]]\nname = "alice"\n'
                    f'key_sha256 = "{hash_key(ALICE)}"\n')
    # Speculation off: dummy:tiny's drafts are all accepted, and the streams the views are
    # read from would end before they are seen.
    with ServerProcess("--profile", "ci", "--tenants", str(path), "--speculative", "off") as server:
        yield server


@contextmanager
def live_streams(server, count: int):
    """count streaming requests sharing a system prompt, decoding until the block exits (then
    the clients hang up and the server aborts them). Each starts once the one before it
    decodes, so the later ones find the shared prefix cached. Yields the refusals (none)."""
    stop = threading.Event()
    refusals: list[str] = []

    def stream(index: int) -> None:
        body = anthropic_body(f"request {index}", max_tokens=1800, ignore_eos=True,
                              temperature=0, system=SYSTEM)
        with httpx.Client(base_url=server.url, timeout=120,
                          headers={"x-api-key": ALICE}) as client:
            with client.stream("POST", "/v1/messages", json=body) as response:
                if response.status_code != 200:
                    refusals.append(response.read().decode())
                for _ in response.iter_bytes():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    try:
        for started, thread in enumerate(threads, 1):
            thread.start()
            wait_for_state(server, lambda s: sum(r["output_tokens"] > 0
                                                 for r in s["requests"]) >= started, refusals)
        yield refusals
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)


def wait_for_state(server, predicate, refusals=(), timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        assert not refusals
        state = server.state(**{"x-api-key": ADMIN})
        if predicate(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"state never matched: {state}")
        time.sleep(0.1)


def test_state_carries_cached_runs_phases_and_process_usage(server):
    with live_streams(server, 3) as refusals:
        state = wait_for_state(server, lambda s: len(s["requests"]) == 3 and all(
            r["phase"] == "decode" and r["output_tokens"] > 2 for r in s["requests"]), refusals)
        kv = state["kv"]
        block_map = kv["block_map"]
        assert sum(n for _, n in block_map["cached"]) == kv["cached_blocks"] > 0
        # Every holder of a block is a running request listed in owners.
        holders = [0] * kv["num_blocks"]
        for runs in block_map["owners"].values():
            for first, count in runs:
                for block_id in range(first, first + count):
                    holders[block_id] += 1
        pool = blocks(Kv.from_wire(kv))
        assert holders == [b.ref_count for b in pool]
        assert sum(1 for b in pool if b.ref_count == 3) >= 2  # the shared system prompt
        batch = state["batch"]
        # Prompts and shared prefix prefilled once each; then one token per stream per step.
        assert 0 < batch["prefill_tokens_total"] and batch["decode_tokens_total"] >= 3 * 2
        rank = state["ranks"][0]
        assert rank["rss_bytes"] > 0 and state["memory"]["host"]["cpu_count"] >= 1
        again = server.state(**{"x-api-key": ADMIN})
        assert again["ranks"][0]["cpu_percent"] is not None  # measured since the last snapshot
        assert again["ranks"][0]["cpu_percent"] > 0  # the rank is decoding
    wait_for_state(server, lambda s: not s["requests"] and s["kv"]["used_blocks"] == 0)


def test_top_without_the_admin_key_says_so(server):
    async def main() -> None:
        app = TopApp(HttpSource(server.url), interval_s=0.2)
        async with app.run_test(size=(160, 50)) as pilot:
            for _ in range(100):
                if "admin key" in str(app.main.query_one("#header").render()):
                    break
                await pilot.pause(0.2)
            header = str(app.main.query_one("#header").render())
            assert "/v1/state: 401, the admin key was missing (--admin-key)" in header

    asyncio.run(main())


def test_top_follows_live_streams_then_shows_the_server_gone(server):
    async def main() -> None:
        app = TopApp(HttpSource(server.url, ADMIN), interval_s=0.2)
        async with app.run_test(size=(160, 50)) as pilot:
            table = app.main.query_one("#requests-small", RequestsTable)
            with live_streams(server, 2) as refusals:
                for _ in range(300):
                    if sum(str(table.get_cell(key, "state")) == "decode"
                           for key in table.rows) == 2:
                        break
                    await pilot.pause(0.2)
                assert not refusals
                header = str(app.main.query_one("#header").render())
                assert "dummy:tiny" in header and "● ready" in header
                assert table.row_count == 2
                # The youngest first (it has the most tokens left), and open it.
                await pilot.press("r", "enter")
                assert isinstance(app.screen, DetailScreen)
                text = app.screen.query_one("#text")
                for _ in range(300):
                    if len(str(text.render())) > 20:
                        break
                    await pilot.pause(0.2)
                first = str(text.render())
                fields = app.screen.query_one("#fields")

                def output_tokens() -> int:
                    return int(re.search(r"output (\d+)/", str(fields.render())).group(1))

                first_count = output_tokens()
                assert len(first) > 20
                for _ in range(300):
                    if output_tokens() > first_count:
                        break
                    await pilot.pause(0.2)
                # It streams: the output count moves on, and the text with it (the window
                # holds the last 2,000 characters; dummy:tiny may repeat one character).
                assert output_tokens() > first_count
                assert len(str(text.render())) > len(first) or len(first) == 2000
                assert "finished" not in str(app.screen.query_one("#notice").render())
                await pilot.press("escape")
            server.stop()
            for _ in range(100):
                if "disconnected — retrying" in str(app.main.query_one("#header").render()):
                    break
                await pilot.pause(0.2)
            assert "disconnected — retrying" in str(app.main.query_one("#header").render())
            header = str(app.main.query_one("#header").render())
            assert "dummy:tiny" in header  # the last snapshot stays on screen

    asyncio.run(main())
