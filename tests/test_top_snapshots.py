"""`tokstream top` screenshots at fixed terminal sizes (pytest-textual-snapshot), over replies
recorded from a real server. After a deliberate change to the view, look at the new SVGs and
accept them with `pytest tests/test_top_snapshots.py --snapshot-update`."""

from __future__ import annotations

import copy

import pytest

from helpers.top_replay import Replay, first_poll, replay_app

pytestmark = pytest.mark.timeout(120)


def after_polls(replay: Replay, polls: int, *keys: str):
    """Poll the recording polls times (rates need two frames, sparklines more), then press
    keys."""
    async def run_before(pilot) -> None:
        app = pilot.app
        await first_poll(app, pilot)
        for _ in range(polls - 1):
            replay.advance()
            await app.poll_once()
        await pilot.press(*keys)
        await app.workers.wait_for_complete()
        await pilot.pause()
    return run_before


def test_overview(snap_compare):
    replay = Replay(start=0)
    assert snap_compare(replay_app(replay), terminal_size=(160, 50),
                        run_before=after_polls(replay, 7))


def test_overview_small_terminal_draws_block_ranges(snap_compare):
    replay = Replay(start=2)
    assert snap_compare(replay_app(replay), terminal_size=(80, 24),
                        run_before=after_polls(replay, 2))


def test_detail_of_the_oldest_request(snap_compare):
    replay = Replay(start=10)
    assert snap_compare(replay_app(replay), terminal_size=(120, 30),
                        run_before=after_polls(replay, 2, "enter"))


def test_disconnected(snap_compare):
    replay = Replay(start=2)

    async def run_before(pilot) -> None:
        await after_polls(replay, 2)(pilot)
        replay.down = True
        await pilot.app.poll_once()
        await pilot.pause()
    assert snap_compare(replay_app(replay), terminal_size=(120, 30), run_before=run_before)


POLICY = {"long_prefill_tokens": 2048, "long_prefill_share": 0.5, "long_step_ms": 150.0,
          "long_share": 0.31, "long_first": False,
          "long_prefills": [
              {"id": "msg_01flood0", "tenant": "default", "prompt_tokens": 8176,
               "left_tokens": 6120, "state": "running", "held": True},
              {"id": "msg_01flood1", "tenant": "default", "prompt_tokens": 8176,
               "left_tokens": 8176, "state": "waiting", "held": True}]}
"""A core's prefill_policy while a chat prompt goes before two 8k-token prompts (issue 29)."""


class PolicyReplay(Replay):
    """The recording, its core reporting POLICY (the recording predates the field)."""

    @property
    def frame(self) -> dict:
        frame = copy.deepcopy(super().frame)
        frame["state"]["batch"]["prefill_policy"] = POLICY
        return frame


def test_overview_shows_the_long_prefill_held_back(snap_compare):
    replay = PolicyReplay(start=0)
    assert snap_compare(replay_app(replay), terminal_size=(160, 50),
                        run_before=after_polls(replay, 7))
