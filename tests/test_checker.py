"""The stream checker on hand-built streams: a clean stream passes, each kind of damage is
named. (The same damage made by the real demux is in test_server_demux.py.)"""

import json

from tokstream.checker import RecordedStream, SSEEvent, check_streams, parse_sse
from tokstream.engine.messages.request import token_digest

TOKENS = [11, 12, 13, 14, 15]


def anthropic_events(request_id="msg_a", tokens=TOKENS, indices=None, stamp=None, final=True,
                     digest=None, count=None):
    indices = list(range(len(tokens))) if indices is None else indices
    events = [SSEEvent("message_start", json.dumps(
        {"type": "message_start", "message": {"id": request_id, "type": "message"}}))]
    for token, index in zip(tokens, indices):
        events.append(SSEEvent("content_block_delta", json.dumps({
            "type": "content_block_delta", "delta": {"type": "text_delta", "text": f"t{token}"},
            "tokstream": {"request_id": stamp or request_id, "token_ids": [token],
                          "indices": [index]}}), str(index)))
    if final:
        events.append(SSEEvent("message_delta", json.dumps({
            "type": "message_delta", "tokstream": {
                "request_id": request_id, "num_output_tokens": count or len(TOKENS),
                "digest": digest or token_digest(TOKENS), "finish_reason": "length"}})))
        events.append(SSEEvent("message_stop", '{"type":"message_stop"}'))
    return events


def check(events, request_id=None):
    report = check_streams([RecordedStream(events, request_id)])
    return report, report.streams[0]


def test_clean_stream_passes():
    report, stream = check(anthropic_events())
    assert report.ok, report.summary()
    assert stream.status == "complete" and stream.token_ids == TOKENS
    assert stream.text == "t11t12t13t14t15"


def test_each_kind_of_damage_is_named():
    cases = {
        "lost": anthropic_events(tokens=[11, 12, 14, 15], indices=[0, 1, 3, 4]),
        "duplicated": anthropic_events(tokens=[11, 12, 13, 13, 14, 15],
                                       indices=[0, 1, 2, 2, 3, 4]),
        "reordered": anthropic_events(tokens=[11, 12, 14, 13, 15], indices=[0, 1, 3, 2, 4]),
        "foreign": anthropic_events(stamp="msg_other"),
        "never_ended": anthropic_events(final=False),
        "digest_mismatch": anthropic_events(tokens=[11, 12, 99, 14, 15]),
        "count_mismatch": anthropic_events(count=6),
    }
    for kind, events in cases.items():
        report, _ = check(events)
        assert not report.ok, kind
        assert report.count(kind) >= 1, (kind, report.summary())


def test_ended_twice_and_events_after_the_end():
    events = anthropic_events()
    events += events[-2:]
    report, _ = check(events)
    assert report.count("ended_twice") == 1
    events = anthropic_events() + anthropic_events()[1:2]
    report, _ = check(events)
    assert report.count("after_end") == 1


def test_error_event_is_an_explicit_end():
    events = anthropic_events(final=False) + [SSEEvent("error", json.dumps(
        {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}))]
    report, stream = check(events)
    assert report.ok and stream.status == "failed"
    assert stream.error["type"] == "overloaded_error"


def test_same_request_in_two_streams_is_foreign():
    report = check_streams([RecordedStream(anthropic_events()),
                            RecordedStream(anthropic_events())])
    assert report.count("foreign") == 1


def test_parses_openai_framing_with_comments_and_done():
    chunks = [{"id": "c1", "choices": [{"delta": {"content": f"t{t}"}}],
               "tokstream": {"request_id": "c1", "token_ids": [t], "indices": [i]}}
              for i, t in enumerate(TOKENS)]
    text = "".join(f"id: {i}\ndata: {json.dumps(c)}\n\n: ping\n" for i, c in enumerate(chunks))
    text += "data: " + json.dumps({"id": "c1", "choices": [{"delta": {}, "finish_reason": "length"}],
                                   "tokstream": {"num_output_tokens": 5,
                                                 "digest": token_digest(TOKENS)}}) + "\n\n"
    text += "data: [DONE]\n\n"
    report = check_streams([RecordedStream(parse_sse(text))])
    assert report.ok, report.summary()
    assert report.streams[0].text == "t11t12t13t14t15"


def test_a_foreign_token_merged_behind_the_callers_own_is_foreign():
    """A lagging client gets merged events: the event's request_id is its first token's, and
    `request_ids` names each token's. A misrouted token second in such an event must read as
    foreign (seen in a demux-mutation run), not as a duplicated or reordered index."""
    events = anthropic_events(tokens=[11, 12], indices=[0, 1], final=False)
    events.append(SSEEvent("content_block_delta", json.dumps({
        "type": "content_block_delta", "delta": {"type": "text_delta", "text": "t13t77"},
        "tokstream": {"request_id": "msg_a", "request_ids": ["msg_a", "msg_other"],
                      "token_ids": [13, 77], "indices": [2, 2]}}), "2"))
    for token, index in ((14, 3), (15, 4)):
        events.append(SSEEvent("content_block_delta", json.dumps({
            "type": "content_block_delta", "delta": {"type": "text_delta", "text": f"t{token}"},
            "tokstream": {"request_id": "msg_a", "token_ids": [token], "indices": [index]}}),
            str(index)))
    events += anthropic_events()[-2:]
    report, _ = check(events)
    assert report.count("foreign") == 1 and report.count("duplicated") == 0, report.summary()


def test_an_events_json_object_is_its_data_only_when_that_is_an_object():
    assert SSEEvent("message_start", '{"type": "message_start"}').json_object() == {
        "type": "message_start"}
    assert SSEEvent(None, "[DONE]").json_object() is None
    assert SSEEvent(None, "[1, 2]").json_object() is None
    assert SSEEvent(None, "3").json_object() is None


def test_responses_api_streams_are_named_read_and_failed_explicitly():
    created = SSEEvent("response.created", json.dumps(
        {"type": "response.created", "response": {"id": "resp_a", "output": []}}))
    deltas = [SSEEvent("response.output_text.delta", json.dumps({
        "type": "response.output_text.delta", "delta": f"t{token}",
        "tokstream": {"request_id": "resp_a", "token_ids": [token], "indices": [n]}}), str(n))
        for n, token in enumerate(TOKENS)]
    completed = SSEEvent("response.completed", json.dumps({
        "type": "response.completed", "response": {"id": "resp_a"}, "tokstream": {
            "request_id": "resp_a", "num_output_tokens": 5, "digest": token_digest(TOKENS),
            "finish_reason": "length"}}))
    report, stream = check([created, *deltas, completed])
    assert report.ok, report.summary()
    assert stream.request_id == "resp_a" and stream.text == "t11t12t13t14t15"
    stray = SSEEvent("x", json.dumps({"tokstream": {"request_id": "resp_b", "token_ids": [1],
                                                    "indices": [5]}}), "5")
    assert check([created, *deltas, stray, completed])[0].count("foreign") == 1
    failed = SSEEvent("response.failed", json.dumps({
        "type": "response.failed", "response": {"id": "resp_a", "status": "failed", "error": {
            "code": "overloaded_error", "message": "replica down"}}}))
    report, stream = check([created, *deltas[:2], failed])
    assert report.ok and stream.status == "failed"
    assert stream.error == {"type": "overloaded_error", "message": "replica down"}
    assert check([created, *deltas[:2], failed, completed])[0].count("ended_twice") == 1
