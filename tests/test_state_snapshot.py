"""The typed /v1/state snapshot (tokstream/state_snapshot.py): parsing what a real server
wrote and writing it back changes nothing, old and new peers' keys survive, the enums are
their wire strings, and the OpenAPI schema generated from the classes accepts real replies."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tokstream.core_state import Event, Kv
from tokstream.server.operations.openapi import openapi_schema
from tokstream.state_snapshot import Batch, ReplicaStatus, RequestDetail, StateSnapshot
from tokstream.wire import ABSENT

FRAMES = json.loads((Path(__file__).parent / "data" / "top" / "frames.json").read_text())


def _state_schema(path: str = "/v1/state") -> dict:
    return (openapi_schema()["paths"][path]["get"]["responses"]["200"]["content"]
            ["application/json"]["schema"])


@pytest.mark.parametrize("index", range(len(FRAMES)))
def test_a_recorded_snapshot_round_trips_exactly(index):
    state = FRAMES[index]["state"]
    parsed = StateSnapshot.from_wire(state)
    assert json.dumps(parsed.to_wire()) == json.dumps(state)  # same keys, order and values
    assert parsed.replica.status is ReplicaStatus(state["replica"]["status"])  # an enum member
    assert parsed.kv.num_blocks == state["kv"]["num_blocks"]
    assert [r.id for r in parsed.requests] == [r["id"] for r in state["requests"]]


def test_unknown_keys_ride_along_and_missing_ones_take_defaults():
    event = Event.from_wire({"time": 1.0, "kind": "preempted", "request_id": "r",
                             "reason": "no blocks", "source": "engine"})
    assert event.extra == {"reason": "no blocks", "source": "engine"} and event.source == "engine"
    assert Event(2.0, "refused").source == "gateway"
    newer = Kv.from_wire({"num_blocks": 8, "a_future_field": [1, 2]})
    assert newer.used_blocks == 0 and newer.to_wire() == {"num_blocks": 8,
                                                          "a_future_field": [1, 2]}
    assert Kv.from_wire({}).to_wire() == {}  # a core that never answered: kv stays {}
    # A replica status this reader does not know yet stays its string.
    assert StateSnapshot.from_wire({"replica": {"status": "draining"}}).replica.status == \
        "draining"


def test_keys_only_sometimes_there_are_left_out_when_absent():
    batch = Batch(running=1)
    assert "chunked_prefill" not in batch.to_wire() and batch.chunked_prefill is ABSENT
    assert Batch(chunked_prefill=False, max_prefill_chunk=None).to_wire()["max_prefill_chunk"] \
        is None  # present, and null, when the core said so


def test_replica_status_is_its_wire_string():
    status = ReplicaStatus("recovering")
    assert status == "recovering" and f"replica is {status}" == "replica is recovering"
    assert json.dumps({"status": status}) == '{"status": "recovering"}'


def test_the_openapi_schema_accepts_recorded_replies_and_names_the_statuses():
    schema = _state_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    for frame in FRAMES:
        jsonschema.validate(frame["state"], schema)
    assert schema["properties"]["replica"]["properties"]["status"]["enum"] == [
        "ready", "recovering", "down"]
    broken = json.loads(json.dumps(FRAMES[0]["state"]))
    broken["replica"]["restarts"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_a_request_detail_round_trips():
    detail = {"id": "msg_1", "tenant": None, "api": "anthropic", "prompt_tokens": 3,
              "output_tokens": 2, "max_tokens": 8, "ttft_ms": 5.0, "itl_ms": None,
              "tokens_per_s": None, "age_s": 0.5, "pending_tokens": 0, "cancelled": None,
              "resumes": 0,
              "engine": {"id": "msg_1", "state": "running", "phase": "decode", "tenant": None,
                         "priority": 0, "prompt_tokens": 3, "output_tokens": 2,
                         "computed_tokens": 4, "blocks": 1, "preemptions": 0,
                         "swapped_blocks": 0, "age_s": 0.4, "queue_s": 0.01},
              "state": "running",
              "params": {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                         "seed": 7, "stop": []},
              "delivered_token_ids": [5, 6], "recent_text": "hi"}
    parsed = RequestDetail.from_wire(detail)
    assert parsed.engine.phase == "decode" and parsed.params.seed == 7
    assert json.dumps(parsed.to_wire()) == json.dumps(detail)
    jsonschema.validate(detail, _state_schema("/v1/state/requests/{request_id}"))
