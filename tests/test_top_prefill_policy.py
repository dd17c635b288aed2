"""top shows the two latency classes from /v1/state's batch.prefill_policy (issue 29): which
long prefill is held back behind short prompts, the long share against its guarantee; nothing
for a core that does not report it."""

from __future__ import annotations

import asyncio

import pytest

from helpers.top_replay import Replay, first_poll, replay_app
from test_top_snapshots import POLICY, PolicyReplay
from tokstream.state_snapshot import Batch, PrefillPolicy
from tokstream.top.header import describe_policy

pytestmark = pytest.mark.timeout(120)


def test_the_policy_parses_from_the_wire():
    batch = Batch.from_wire({"running": 3, "prefill_policy": POLICY})
    assert isinstance(batch.prefill_policy, PrefillPolicy)
    assert [row.id for row in batch.prefill_policy.held] == ["msg_01flood0", "msg_01flood1"]
    assert batch.to_wire()["prefill_policy"] == POLICY


def test_the_held_prompt_with_the_most_left_is_named():
    text = describe_policy(PrefillPolicy.from_wire(POLICY)).plain
    assert text == ("long prefills 2 2 held (most left: msg_01flood1 8,176 tokens)  share 31% of "
                    "prefill, 50% guaranteed  chunks ≤150 ms  long past 2,048 tokens")
    first = describe_policy(PrefillPolicy.from_wire({**POLICY, "long_first": True})).plain
    assert first.startswith("long prefills 2 first  share 31%")


@pytest.mark.parametrize("with_policy", [True, False])
def test_the_header_shows_the_policy_only_when_reported(with_policy):
    replay = PolicyReplay(start=2) if with_policy else Replay(start=2)

    async def pilot_run():
        app = replay_app(replay)
        async with app.run_test(size=(160, 50)) as pilot:
            await first_poll(app, pilot)
            await pilot.pause()
            header = str(app.main.query_one("#header").render())
            assert ("long prefills 2 2 held (most left: msg_01flood1" in header) is with_policy
    asyncio.run(pilot_run())
