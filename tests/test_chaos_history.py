"""The chaos history checker on hand-built histories (no server): classes, what a client's own
hang-up excuses and what it does not, refusals, and what a fault did to each stream."""

import ast
import json
import subprocess
import sys

import pytest

from tokstream.chaos.history import Violations, check_history
from tokstream.chaos.timeline import around_fault
from tokstream.state_snapshot import RequestRow
from tokstream.chaos.workload import StreamHistory, StreamSpec
from tokstream.checker import SSEEvent
from tokstream.engine.messages.request import token_digest

pytestmark = pytest.mark.timeout(30)


def history(tokens, final=True, hung_up=False, status=200, error=None, request_id="msg_1",
            times=None):
    """An Anthropic-route history with these (index, token) pairs, one per event."""
    spec = StreamSpec("s0", "/v1/messages", {"max_tokens": 8, "temperature": 0})
    h = StreamHistory(spec, started=0.0, status_code=status, request_id=request_id,
                      hung_up=hung_up)
    times = times or [1.0 + n for n in range(len(tokens))]
    h.events.append((0.5, SSEEvent("message_start", json.dumps(
        {"type": "message_start", "message": {"id": request_id}}))))
    for t, (index, token) in zip(times, tokens):
        data = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"},
                "tokstream": {"request_id": request_id, "token_ids": [token],
                              "indices": [index]}}
        h.events.append((t, SSEEvent("content_block_delta", json.dumps(data), str(index))))
        h.tokens.append((t, index, token, None))
    if error:
        h.events.append((99.0, SSEEvent("error", json.dumps(
            {"type": "error", "error": {"type": error, "message": "replica down"}}))))
    elif final:
        ids = [token for _, token in tokens]
        h.events.append((99.0, SSEEvent("message_delta", json.dumps(
            {"type": "message_delta", "tokstream": {
                "num_output_tokens": len(ids), "digest": token_digest(ids),
                "finish_reason": "length"}}))))
    h.ended_at = 99.0 if (final or error) else 50.0
    return h


def test_a_clean_complete_stream_has_no_violation():
    violations = Violations()
    rows = check_history([history([(0, 5), (1, 6), (2, 7)])], violations)
    assert violations.ok and rows[0]["class"] == "complete" and rows[0]["token_ids"] == [5, 6, 7]


def test_each_corruption_is_its_own_violation():
    cases = {"lost": [(0, 5), (2, 7)], "duplicated": [(0, 5), (1, 6), (1, 6)],
             "reordered": [(1, 6), (0, 5)]}
    for kind, tokens in cases.items():
        violations = Violations()
        check_history([history(tokens)], violations)
        assert violations.counts[kind] >= 1, (kind, violations.details)


def test_a_token_stamped_for_another_request_is_foreign():
    h = history([(0, 5), (1, 6)])
    t, event = h.events[2]
    data = json.loads(event.data)
    data["tokstream"]["request_id"] = "msg_other"
    h.events[2] = (t, SSEEvent(event.event, json.dumps(data), event.id))
    violations = Violations()
    check_history([h], violations)
    assert violations.counts["foreign"] == 1


def test_a_stream_without_an_end_is_unended_unless_its_client_hung_up():
    violations = Violations()
    rows = check_history([history([(0, 5), (1, 6)], final=False)], violations)
    assert rows[0]["class"] == "cut" and violations.counts["unended"] == 1
    violations = Violations()
    rows = check_history([history([(0, 5), (1, 6)], final=False, hung_up=True)], violations)
    assert rows[0]["class"] == "cut" and rows[0]["client"] == "hung up" and violations.ok
    # What a client that hung up did receive must still be whole.
    violations = Violations()
    check_history([history([(0, 5), (2, 7)], final=False, hung_up=True)], violations)
    assert violations.counts["lost"] == 1


def test_an_explicit_error_is_a_failed_stream_and_a_refusal_is_counted():
    violations = Violations()
    rows = check_history([history([(0, 5)], error="overloaded_error")], violations)
    assert rows[0]["class"] == "failed" and violations.ok
    refused = history([], final=False, status=529)
    refused.body = '{"type":"error"}'
    rows = check_history([refused], violations)
    assert rows[0]["class"] == "refused" and violations.counts["refused"] == 1


def test_around_fault_measures_the_pause_and_flags_a_stream_that_never_came_back():
    resumed = history([(0, 5), (1, 6), (2, 7)], times=[1.0, 2.0, 7.5])
    stuck = history([(0, 5)], final=False, request_id="msg_2", times=[1.5])
    stuck.ended_at = 60.0
    finished_before = history([(0, 5)], request_id="msg_3", times=[0.8])
    finished_before.ended_at = 1.0
    violations = Violations()
    rows, recovery = around_fault([resumed, stuck, finished_before], fault_s=2.5,
                                  state_rows={"msg_1": RequestRow.from_wire({
                                      "state": "running", "prompt_tokens": 9,
                                      "computed_tokens": 11, "output_tokens": 2})},
                                  violations=violations)
    assert [r["request_id"] for r in rows] == ["msg_1", "msg_2"]
    assert rows[0]["tokens_before"] == 2 and rows[0]["tokens_after"] == 1
    assert rows[0]["pause_s"] == pytest.approx(5.5) and recovery == pytest.approx(5.0)
    assert rows[0]["state_at_fault"] == "decoding (token 2)"
    assert violations.counts["not_recovered"] == 1


def test_chaos_imports_no_torch_and_no_engine_code():
    code = ("import sys, tokstream.chaos.cli, tokstream.chaos.runner; "
            "assert 'torch' not in sys.modules, 'torch'; "
            "print(sorted(m for m in sys.modules if m.startswith('tokstream.engine')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    # Only the plain-data package the stream checker takes the digest function from.
    engine = ast.literal_eval(result.stdout)
    assert [m for m in engine if m.split(".")[:3] != ["tokstream", "engine", "messages"]] == \
        ["tokstream.engine"], engine
