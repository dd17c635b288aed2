"""top shows speculative decoding when /v1/state says it is on (issue 34 item 5): the header's
method, k and acceptance (since the start, between the last two polls, per draft position),
each request's accepted/drafted tokens in the requests table and its detail; nothing of it with
speculation off or from a core that sends no section."""

from __future__ import annotations

import asyncio
import copy

import pytest

from helpers.top_replay import FRAMES, Replay, first_poll, open_detail, replay_app
from tokstream.state_snapshot import RequestDetail
from tokstream.top.detail import describe
from tokstream.top.tables import RequestsTable

pytestmark = pytest.mark.timeout(120)


def speculation(index: int, method: str = "ngram") -> dict:
    """The section a core with k = 3 sends at recording index: per frame 40 drafts of 100
    tokens, 50 + a growing share of them accepted (so the last poll's acceptance is not the
    overall one)."""
    return {"method": method, "num_speculative_tokens": 3, "num_drafts": 40 * index,
            "num_draft_tokens": 100 * index, "num_accepted_tokens": 50 * index + 4 * index ** 2,
            "accepted_per_position": [30 * index, 14 * index, 6 * index + 4 * index ** 2],
            "acceptance_rate": (50 + 4 * index) / 100 if index else None}


class SpecReplay(Replay):
    """The recording (it predates speculation) with `section(index)` as its speculation
    section, or none; with a section that is on, every request in the core has drafted three
    tokens per output token and had one accepted."""

    def __init__(self, start: int, section=speculation):
        super().__init__(start)
        self.section = section

    @property
    def frame(self) -> dict:
        frame = copy.deepcopy(super().frame)
        spec = self.section and self.section(self.index)
        if spec is None:
            return frame
        frame["state"]["speculation"] = spec
        if spec["method"] == "off":
            return frame
        for row in frame["state"]["requests"]:
            if row["phase"] not in ("submitted", "finishing"):
                row["draft_tokens"], row["accepted_tokens"] = 3 * row["output_tokens"], \
                    row["output_tokens"]
        for detail in frame["requests"].values():
            if detail.get("engine"):
                detail["engine"]["draft_tokens"] = 3 * detail["output_tokens"]
                detail["engine"]["accepted_tokens"] = detail["output_tokens"]
        return frame


def pilot_run(replay: Replay, check) -> None:
    """Two polls (frames 2 and 3) at 160 x 50, then check(app, pilot)."""
    async def body():
        app = replay_app(replay)
        async with app.run_test(size=(160, 50)) as pilot:
            await first_poll(app, pilot)
            replay.advance()
            await app.poll_once()
            await pilot.pause()
            await check(app, pilot)
    asyncio.run(body())


def header(app) -> str:
    return str(app.main.query_one("#header").render())


def accepted_cells(app) -> dict[str, str] | None:
    """Request id -> its ACCEPTED cell, None without the column."""
    table = app.main.query_one("#requests-small", RequestsTable)
    if "accepted" not in table.columns:
        return None
    return {key.value: str(table.get_cell(key, "accepted")) for key in table.rows}


def test_the_header_shows_method_k_and_acceptance_overall_recent_and_per_position():
    async def check(app, pilot):
        # At frame 3: 186 of 300 tokens accepted since the start; 70 of the 100 drafted
        # since frame 2; by position 90, 42 and 54 of 120 drafts.
        assert ("speculation ngram k=3  accepted 186/300 drafted tokens 62% since start, "
                "70% last poll  by position 75% 35% 45%") in header(app)
    pilot_run(SpecReplay(start=2), check)


def test_each_request_shows_accepted_over_drafted_tokens():
    async def check(app, pilot):
        rows = {row["id"]: row for row in FRAMES[3]["state"]["requests"]}
        cells = accepted_cells(app)
        assert cells is not None and set(cells) == set(rows)
        for request_id, row in rows.items():
            drafted = row["phase"] not in ("submitted", "finishing")
            assert cells[request_id] == (f"{row['output_tokens']}/{3 * row['output_tokens']}"
                                         if drafted else "-")
        assert any(cell not in ("-", "0/0") for cell in cells.values())
        request_id = next(iter(FRAMES[3]["requests"]))
        screen = await open_detail(app, pilot, request_id)
        output = FRAMES[3]["requests"][request_id]["output_tokens"]
        assert f"drafted {3 * output} accepted {output} (33%)" in str(screen.fields.render())
    pilot_run(SpecReplay(start=2), check)


@pytest.mark.parametrize("section", [None, lambda index: {"method": "off"}],
                         ids=["no-section", "method-off"])
def test_nothing_of_it_with_speculation_off(section):
    async def check(app, pilot):
        assert "speculation" not in header(app) and "drafted" not in header(app)
        assert accepted_cells(app) is None
        request_id = next(iter(FRAMES[3]["requests"]))
        screen = await open_detail(app, pilot, request_id)
        assert "drafted" not in str(screen.fields.render())
    pilot_run(SpecReplay(start=2, section=section), check)


def test_a_method_top_does_not_know_and_fields_it_does_not_name_still_show():
    """Another method (auto) and a key this top predates: the figures it knows, no error."""
    def auto(index):
        return {**speculation(index, "auto"), "chosen_tokens": 2}

    async def check(app, pilot):
        assert app.failures == 0
        assert "speculation auto k=3  accepted 186/300 drafted tokens 62%" in header(app)
    pilot_run(SpecReplay(start=2, section=auto), check)


def test_before_any_draft_and_on_a_single_poll_the_rates_are_dashes():
    async def body():
        replay = SpecReplay(start=0)  # index 0: speculation on, nothing drafted yet
        app = replay_app(replay)
        async with app.run_test(size=(160, 50)) as pilot:
            await first_poll(app, pilot)
            assert ("speculation ngram k=3  accepted 0/0 drafted tokens - since start, - last "
                    "poll") in header(app)
            assert "by position" not in header(app)
    asyncio.run(body())


def test_a_detail_without_a_core_row_shows_no_drafts():
    row = RequestDetail.from_wire({"id": "msg_1", "state": "submitted", "engine": None})
    assert "drafted" not in describe(row).plain
    row = RequestDetail.from_wire({"id": "msg_1", "engine": {"id": "msg_1", "draft_tokens": 0,
                                                               "accepted_tokens": 0}})
    assert "drafted 0 accepted 0" in describe(row).plain
