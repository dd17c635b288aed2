"""`tokstream top` driven by a pilot over replies recorded from a real server under load
(tests/top_replay.py): what it shows, its keys (sort, reverse, filter, views, pause, help,
detail, back, quit) and the disconnected state. No server runs here."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys

import httpx
import pytest
from typer.testing import CliRunner

from helpers.top_replay import FRAMES, Replay, first_poll, open_detail, replay_app
from tokstream.cli import app as cli
from tokstream.core_state import Event, Kv
from tokstream.state_snapshot import StateSnapshot
from tokstream.top.detail import DetailScreen
from tokstream.top.help import HelpScreen
from tokstream.top.kv_map import CACHED, FREE, SHARED, blocks, cells
from tokstream.top.source import HttpSource, SourceError, parse_counters
from tokstream.top.tables import WIDTHS, RequestsTable
from tokstream.top.view import History, filter_rows, request_rows, tenant_rows
from tokstream.top.source import Frame

pytestmark = pytest.mark.timeout(120)
SIZE = (160, 50)


def run(test):
    """An async pilot test as a plain one (the suite has no asyncio plugin)."""
    @functools.wraps(test)
    def wrapper():
        asyncio.run(test())
    return wrapper


def header_text(app) -> str:
    return str(app.main.query_one("#header").render())


def table_ids(app, table_id: str = "#requests-small") -> list[str]:
    table = app.main.query_one(table_id, RequestsTable)
    return [table.coordinate_to_cell_key((row, 0)).row_key.value
            for row in range(table.row_count)]


def table_column(app, column: str, table_id: str = "#requests-small") -> list:
    table = app.main.query_one(table_id, RequestsTable)
    return [str(table.get_cell(key, column)) for key in table_ids(app, table_id)]




async def poll(app, pilot) -> None:
    await app.poll_once()
    await pilot.pause()


def test_recorded_frames_hold_what_top_needs():
    """The fixture is what a real server says (not hand-made): load, sharing, preemption and
    a rank restart are in it, so the tests below see them."""
    phases = {r["phase"] for f in FRAMES for r in f["state"]["requests"]}
    assert {"prefill", "decode", "waiting", "preempted", "recovering"} <= phases
    assert any(f["state"]["replica"]["status"] == "recovering" for f in FRAMES)
    assert any("2" in f["state"]["kv"]["block_map"]["ref_counts"] for f in FRAMES)
    assert any(e["kind"] == "rank_failure" for f in FRAMES for e in f["state"]["events"])
    assert all(f["requests"] for f in FRAMES)


@run
async def test_overview_shows_header_pool_batch_and_requests():
    replay = Replay(start=2)
    app = replay_app(replay)
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        replay.advance()
        await poll(app, pilot)
        state = replay.frame["state"]
        header = header_text(app)
        assert "dummy:tiny" in header and "cpu float32" in header and "TP 1" in header
        assert "● ready" in header and f"rank0 ● pid {state['ranks'][0]['pid']}" in header
        # Output tokens/s: the /metrics counter's growth over the server's uptime between polls.
        before, after = FRAMES[2], FRAMES[3]
        grown = (parse_counters(after["metrics"])["output_tokens"]
                 - parse_counters(before["metrics"])["output_tokens"])
        elapsed = after["state"]["replica"]["uptime_s"] - before["state"]["replica"]["uptime_s"]
        assert grown > 0 and f"output {grown / elapsed:,.0f} tok/s" in header
        prefilled = (after["state"]["batch"]["prefill_tokens_total"]
                     - before["state"]["batch"]["prefill_tokens_total"])
        assert prefilled > 0 and f"prompt {prefilled / elapsed:,.0f} tok/s" in header
        assert sorted(table_ids(app)) == sorted(r["id"] for r in state["requests"])
        kv = state["kv"]
        assert f"KV {kv['used_blocks']}/{kv['num_blocks']} used" in str(
            app.main.query_one("#kv-small").render())
        batch = state["batch"]
        assert f"running {batch['running']}/{batch['max_num_seqs']} seqs" in str(
            app.main.query_one("BatchPanel").seqs.render())
        assert f"waiting {batch['waiting']}" in str(app.main.query_one("BatchPanel").queue.render())


@run
async def test_sort_cycles_columns_and_reverses():
    app = replay_app(Replay(start=3))
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        ages = [r["age_s"] for r in FRAMES[3]["state"]["requests"]]
        by_age = [r["id"] for r in sorted(FRAMES[3]["state"]["requests"],
                                          key=lambda r: -r["age_s"])]
        assert len(set(ages)) == len(ages) and table_ids(app) == by_age  # default: oldest first
        await pilot.press("s")  # id -> tenant ... the cycle starts after age: at id
        assert app.main.sort_column == "id"
        assert table_ids(app) == sorted(by_age, reverse=True)
        await pilot.press("r")
        assert table_ids(app) == sorted(by_age)
        await pilot.press("s")
        tenants = table_column(app, "tenant")
        assert tenants == sorted(tenants) and len(set(tenants)) == 2
        for _ in range(5):  # tenant -> state -> prompt -> output -> blocks -> ttft
            await pilot.press("s")
        assert app.main.sort_column == "ttft_ms"
        ttfts = [r["ttft_ms"] for r in FRAMES[3]["state"]["requests"]]
        shown = table_column(app, "ttft_ms")
        assert shown.count("-") == ttfts.count(None) and shown[-1] == "-"  # missing: last
        assert "TTFT ▲" in str(app.main.query_one("#requests-small", RequestsTable).columns[
            "ttft_ms"].label)


@run
async def test_filter_by_tenant_and_state_then_clear():
    app = replay_app(Replay(start=3))
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        rows = FRAMES[3]["state"]["requests"]
        await pilot.press("slash", "b", "o", "b", "enter")
        bob = {r["id"] for r in rows if r["tenant"] == "bob"}
        assert set(table_ids(app)) == bob and 0 < len(bob) < len(rows)
        assert "match filter 'bob'" in header_text(app)
        await pilot.press("slash", "space", "d", "e", "c", "o", "d", "e", "enter")
        assert set(table_ids(app)) == {r["id"] for r in rows
                                       if r["tenant"] == "bob" and r["phase"] == "decode"}
        await pilot.press("escape")
        assert len(table_ids(app)) == len(rows) and app.main.filter_text == ""


def followed_request() -> tuple[int, str, int]:
    """(frame, id, later frame): a request whose detail the recording has in two frames in a
    row with different text, gone from a later frame (it finished)."""
    for index, frame in enumerate(FRAMES[:-2]):
        for request_id, detail in frame["requests"].items():
            after = FRAMES[index + 1]["requests"].get(request_id)
            gone = [j for j in range(index + 2, len(FRAMES)) if request_id not in
                    {r["id"] for r in FRAMES[j]["state"]["requests"]}]
            if after and after["recent_text"] != detail["recent_text"] and gone:
                return index, request_id, gone[0]
    raise AssertionError("the recording follows no request to its end")


@run
async def test_enter_opens_a_request_whose_text_streams_and_esc_goes_back():
    start, request_id, finished = followed_request()
    replay = Replay(start)
    app = replay_app(replay)
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        await open_detail(app, pilot, request_id)
        first = FRAMES[start]["requests"][request_id]
        assert str(app.screen.query_one("#text").render()) == first["recent_text"]
        assert f"output {first['output_tokens']}/{first['max_tokens']}" in str(
            app.screen.query_one("#fields").render())
        replay.advance()
        await app.screen.refresh_request()  # what its timer does every interval
        await pilot.pause()
        later = FRAMES[start + 1]["requests"][request_id]["recent_text"]
        assert str(app.screen.query_one("#text").render()) == later
        replay.index = finished
        await app.screen.refresh_request()
        await pilot.pause()
        assert "finished" in str(app.screen.query_one("#notice").render())
        assert str(app.screen.query_one("#text").render()) == later  # the last text stays
        await pilot.press("escape")
        assert not isinstance(app.screen, DetailScreen)


@run
async def test_disconnected_shows_retrying_keeps_last_view_and_resumes():
    replay = Replay(start=4)
    app = replay_app(replay)
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        shown = table_ids(app)
        replay.down = True
        await poll(app, pilot)
        await poll(app, pilot)
        assert "disconnected — retrying" in header_text(app)
        assert "2 failed: ConnectError" in header_text(app)
        assert table_ids(app) == shown  # the last snapshot stays on screen
        replay.down = False
        replay.advance()
        await poll(app, pilot)
        assert "disconnected" not in header_text(app)
        assert sorted(table_ids(app)) == sorted(r["id"] for r in replay.frame["state"]["requests"])


@run
async def test_a_rank_restart_shows_recovering_requests_and_the_events():
    replay = Replay(start=7)
    app = replay_app(replay)
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        replay.advance()  # the replica is recovering: every live request waits on it
        await poll(app, pilot)
        assert replay.frame["state"]["replica"]["status"] == "recovering"
        assert "● recovering" in header_text(app)
        assert set(table_column(app, "state")) == {"recovering"}
        replay.advance()  # back: the requests re-prefilling show as recovering until they decode
        await poll(app, pilot)
        resuming = {r["id"] for r in replay.frame["state"]["requests"]
                    if r["phase"] == "recovering"}
        states = dict(zip(table_ids(app), table_column(app, "state")))
        assert resuming and {i for i, s in states.items() if s == "recovering"} == resuming
        await pilot.press("5")
        events = app.main.query_one("#events")
        kinds = [str(events.get_row_at(i)[1]) for i in range(events.row_count)]
        for kind in ("preempted", "replica_recovering", "rank_failure", "restarted",
                     "replica_ready"):
            assert kind in kinds


@run
async def test_views_help_pause_and_quit():
    replay = Replay(start=5)
    app = replay_app(replay)
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        switcher = app.main.query_one("ContentSwitcher")
        for key, view in (("2", "requests"), ("3", "cache"), ("4", "tenants"), ("5", "events"),
                          ("1", "overview"), ("4", "tenants")):
            await pilot.press(key)
            assert switcher.current == view
        tenants = app.main.query_one("#tenants")
        assert tenants.row_count == 2
        await pilot.press("escape")
        assert switcher.current == "overview"
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("p")
        assert "PAUSED" in header_text(app)
        polls = replay.paths.count("/v1/state")
        app.tick()
        await app.workers.wait_for_complete()
        assert replay.paths.count("/v1/state") == polls
        await pilot.press("p")
        app.tick()
        await app.workers.wait_for_complete()
        assert replay.paths.count("/v1/state") == polls + 1
        await pilot.press("q")
    assert app.return_code == 0


@pytest.mark.parametrize("frame", [0, 3])  # a pool filling up, and a full one
def test_kv_map_cells_per_block_and_scaled(frame):
    kv = FRAMES[frame]["state"]["kv"]
    pool = blocks(Kv.from_wire(kv))
    assert len(pool) == kv["num_blocks"]
    assert sum(1 for b in pool if b.ref_count) == kv["used_blocks"]
    kinds = {b.kind for b in pool}
    owners = set(kv["block_map"]["owners"])
    assert kinds - {FREE, CACHED, SHARED} <= owners
    if frame == 3:
        assert SHARED in kinds
    per_cell, drawn = cells(pool, kv["num_blocks"])
    assert per_cell == 1 and len(drawn) == kv["num_blocks"]
    per_cell, drawn = cells(pool, 40)  # a small widget: each cell a range of blocks
    assert per_cell == -(-kv["num_blocks"] // 40) and len(drawn) <= 40
    seen = set()
    for index, (glyph, _) in enumerate(drawn):
        group = pool[index * per_cell:(index + 1) * per_cell]
        used = sum(1 for b in group if b.ref_count)
        assert (glyph in "·▒") == (used == 0)
        assert used == 0 or glyph == "▁▂▃▄▅▆▇█"[-(-used * 8 // len(group)) - 1]
        seen.add(used == 0)
    if frame == 0:
        assert seen == {True, False}  # free ranges and used ones


def test_tenant_shares_and_counts():
    state = FRAMES[3]["state"]
    rows = {r["tenant"]: r for r in tenant_rows(StateSnapshot.from_wire(state))}
    assert set(rows) == {"alice", "bob"}
    assert abs(sum(r["share"] for r in rows.values()) - 1) < 1e-9
    assert sum(r["running"] + r["waiting"] for r in rows.values()) == len(state["requests"])
    assert rows["alice"]["weight"] == 2.0 and rows["bob"]["priority"] == 1


def test_a_batch_request_is_marked_bg_and_found_by_it():
    state = {**FRAMES[3]["state"]}
    state["requests"] = [{**row, "background": i == 0}
                         for i, row in enumerate(state["requests"])]
    rows = request_rows(StateSnapshot.from_wire(state))
    assert rows[0].state.endswith(" bg") and len(rows) > 1
    assert all(len(row.state) <= WIDTHS["state"] for row in rows)  # never cut off
    preempted = {**state, "requests": [{**state["requests"][0], "phase": "preempted"}]}
    assert request_rows(StateSnapshot.from_wire(preempted))[0].state == "preempt bg"
    assert not any(row.state.endswith(" bg") for row in rows[1:])
    assert filter_rows(rows, "bg") == rows[:1]


def test_history_rates_and_a_restarted_server():
    history = History()
    history.add(Frame(StateSnapshot.from_wire(FRAMES[0]["state"]), parse_counters(FRAMES[0]["metrics"])))
    assert history.rate("output_tokens") is None
    history.add(Frame(StateSnapshot.from_wire(FRAMES[1]["state"]), parse_counters(FRAMES[1]["metrics"])))
    assert history.rate("output_tokens") > 0
    history.add(Frame(StateSnapshot.from_wire(FRAMES[0]["state"]), parse_counters(FRAMES[0]["metrics"])))  # uptime fell
    assert history.rate("output_tokens") is None and len(history.series("running")) == 1


def test_parse_counters_sums_labels_and_ignores_the_rest():
    text = ('# HELP vllm:generation_tokens_total x\nvllm:generation_tokens_total{model_name="a"} 5.0\n'
            'vllm:generation_tokens_total{model_name="b b}"} 2\nvllm:generation_tokens_created 9\n'
            'vllm:prompt_tokens_total 7\n')
    assert parse_counters(text) == {"output_tokens": 7.0}


@pytest.mark.parametrize("args, message", [
    (["--url", "localhost:8000"], "--url: expected http://HOST:PORT"),
    (["--interval", "0"], "--interval: must be between 0.1 and 3600"),
])
def test_cli_rejects_bad_options_with_exit_2(args, message):
    result = CliRunner().invoke(cli, ["top", *args])
    assert result.exit_code == 2 and message in result.output


def test_event_log_keeps_what_left_the_servers_window_once_each():
    events = [Event.from_wire(e) for e in FRAMES[9]["state"]["events"]]
    app = replay_app(Replay())
    app._log_events(events[:10])
    app._log_events(events[5:])  # the next poll: the oldest have left the server's window
    assert app.event_log() == sorted(events, key=lambda e: e.time)
    later = max(e.time for e in events) + 1
    many = [Event(later + t, "preempted", "r") for t in range(600)]
    app._log_events(many)  # bounded: the newest 500 stay
    assert app.event_log() == many[100:]


def test_top_imports_neither_torch_nor_the_engine_nor_the_server():
    code = ("import sys, tokstream.cli, tokstream.top.app; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] == 'torch' or m.startswith(('tokstream.engine', "
            "'tokstream.server', 'tokstream.worker'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_without_the_admin_key_top_names_the_state_route_whichever_fails_first():
    """/v1/state and /metrics are asked at once; both 401 without the key, /metrics here
    first: the message still names /v1/state (it named whichever failed first)."""
    async def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/state":
            await asyncio.sleep(0.05)
        return httpx.Response(401, json={"error": {"message": "admin key required"}})

    async def main() -> str:
        source = HttpSource("http://tokstream.test", transport=httpx.MockTransport(refuse))
        with pytest.raises(SourceError) as error:
            await source.poll()
        return str(error.value)

    assert asyncio.run(main()).startswith("/v1/state: 401")
