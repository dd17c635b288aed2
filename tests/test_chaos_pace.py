"""The slow-client experiment's pace check (chaos/rounds.py _check_fast_pace), no server: a
reading stream gets a token on every engine step once it decodes, several on a step that
accepted drafts (speculative decoding is on by default), and a step it missed is a stall."""

from tokstream.chaos.history import Violations
from tokstream.chaos.rounds import _check_fast_pace
from tokstream.chaos.workload import StreamHistory, StreamSpec


def history(steps: list[int]) -> StreamHistory:
    """A stream whose tokens came with these engine step ids (the first, its prefill's)."""
    h = StreamHistory(StreamSpec("s0", "/v1/messages", {}), started=0.0)
    h.tokens = [(0.01 * i, i, 7, step) for i, step in enumerate(steps)]
    return h


def stalls(steps: list[int]) -> int:
    violations = Violations()
    _check_fast_pace([history(steps)], [{"name": "s0"}], violations)
    return violations.counts["stalled"]


def test_one_token_a_step_and_several_on_a_step_with_drafts_keep_pace():
    assert stalls([3, 4, 5, 6, 7]) == 0
    assert stalls([3, 4, 4, 4, 5, 6, 6, 7]) == 0  # steps 4 and 6 accepted drafts


def test_a_step_missed_is_a_stall_with_drafts_or_without():
    assert stalls([3, 4, 5, 7, 8]) == 1
    assert stalls([3, 4, 4, 4, 6, 6, 7]) == 1
