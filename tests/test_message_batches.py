"""The Message Batches API (POST/GET /v1/messages/batches...) through the official anthropic
SDK: each result is what POST /v1/messages gives the same params, bad params are errored
results, a batch runs below interactive requests and can be cancelled, and a batch is its
tenant's alone."""

import os
import time

import anthropic
import httpx
import pytest

from helpers.serving import ServerProcess
from helpers.streams_under_fault import kill
from tokstream.server.access.tenants import hash_key
from tokstream.server.api.conversation_store import ConversationStore
from tokstream.server.api_errors import ApiError
from tokstream.server.batches.batch_files import BatchFiles
from tokstream.server.batches.message_batch import BatchItem, MessageBatch, batch_items
from tokstream.server.submit import BACKGROUND_TIER

ALICE, BOB, ADMIN = "sk-alice-batches-0123", "sk-bob-batches-4567", "sk-admin-batches"
CAROL = "sk-carol-batches-89ab"
MODEL = "dummy:tiny"


def params(content: str, max_tokens: int = 12, **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 1.0,
            "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(f'admin_key_sha256 = "{hash_key(ADMIN)}"\n'
                    f'[[tenant]]\nname = "alice"\nkey_sha256 = "{hash_key(ALICE)}"\n'
                    f'[[tenant]]\nname = "bob"\nkey_sha256 = "{hash_key(BOB)}"\n'
                    f'[[tenant]]\nname = "carol"\nkey_sha256 = "{hash_key(CAROL)}"\n'
                    'max_concurrent = 1\ntokens_per_minute = 600\n')
    with ServerProcess("--profile", "ci", "--tenants", str(path),
                       "--batch-concurrency", "2") as server:
        yield server


def sdk(server, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (batch := client.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


@pytest.mark.startup
def test_each_result_is_what_the_messages_route_answers(server):
    client = sdk(server, ALICE)
    good = {f"seeded-{i}": params(f"tell me about {i}", seed=100 + i) for i in range(4)}
    good["stopped"] = params("stop here", max_tokens=30, seed=7, stop_sequences=["w3"])
    bad = {"no-max-tokens": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
           "streamed": params("x", stream=True),
           "other-model": {**params("x"), "model": "no-such-model"},
           "thread": params("x", thread={"id": "t1"})}
    batch = client.messages.batches.create(
        requests=[{"custom_id": key, "params": value} for key, value in {**good, **bad}.items()])
    assert batch.processing_status in ("in_progress", "ended") and batch.results_url is None
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    batch = ended(client, batch.id)
    assert batch.request_counts.succeeded == len(good)
    assert batch.request_counts.errored == len(bad)
    assert batch.request_counts.processing == batch.request_counts.canceled == 0
    assert batch.ended_at >= batch.created_at and batch.results_url.endswith("/results")

    typed = {line.custom_id: line.result for line in client.messages.batches.results(batch.id)}
    raw = httpx.get(batch.results_url, headers={"x-api-key": ALICE}).text.splitlines()
    assert [httpx.Response(200, content=line).json()["custom_id"] for line in raw] == \
        list(good) + list(bad)  # one line per request, in request order
    http = httpx.Client(base_url=server.url, headers={"x-api-key": ALICE}, timeout=60)
    for custom_id, body in good.items():
        assert typed[custom_id].type == "succeeded", typed[custom_id]
        alone = http.post("/v1/messages", json=body).json()
        message = typed[custom_id].message
        assert message.content[0].text == alone["content"][0]["text"]
        assert (message.stop_reason, message.stop_sequence) == (alone["stop_reason"],
                                                                alone["stop_sequence"])
        assert message.usage.output_tokens == alone["usage"]["output_tokens"]
        assert message.model_extra["tokstream"]["token_ids"] == alone["tokstream"]["token_ids"]
    assert typed["stopped"].message.stop_reason in ("stop_sequence", "max_tokens")
    errors = {key: (typed[key].type, typed[key].error.error.type, typed[key].error.error.message)
              for key in bad}
    assert errors["no-max-tokens"][:2] == ("errored", "invalid_request_error")
    assert "max_tokens" in errors["no-max-tokens"][2]
    assert errors["streamed"][1] == "invalid_request_error" and "stream" in errors["streamed"][2]
    assert errors["other-model"][1] == "not_found_error"
    assert errors["thread"][1] == "invalid_request_error" and "thread" in errors["thread"][2]

    deleted = client.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def each_as_messages_gives(server, client, batch_id: str, bodies: dict) -> None:
    """Each result's tokens are what POST /v1/messages gives its params (seeded) now."""
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch_id)}
    http = httpx.Client(base_url=server.url, timeout=60)
    for key, body in bodies.items():
        alone = http.post("/v1/messages", json=body).json()
        assert results[key].message.model_extra["tokstream"]["token_ids"] == \
            alone["tokstream"]["token_ids"], key


def background_rows(server) -> list[dict]:
    return [row for row in server.state(**{"x-api-key": ADMIN})["requests"]
            if (row.get("priority") or 0) >= BACKGROUND_TIER]


@pytest.mark.startup
def test_a_batch_runs_below_interactive_requests_and_cancels(server):
    """--batch-concurrency 2: two of the six long requests run at a time, each in the
    background tier, while an interactive request keeps its own; a cancel aborts the two
    running and the four never started, and frees every block."""
    client = sdk(server, ALICE)
    batch = client.messages.batches.create(requests=[
        {"custom_id": f"long-{i}", "params": params(f"a long one {i}", max_tokens=400,
                                                    ignore_eos=True)} for i in range(6)])
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": ALICE},
                      json={**params("an interactive one", max_tokens=800, ignore_eos=True),
                            "stream": True}, timeout=60) as interactive:
        deadline = time.monotonic() + 60
        while len(rows := background_rows(server)) < 2:
            assert time.monotonic() < deadline, server.state(**{"x-api-key": ADMIN})
            time.sleep(0.05)
        live = server.state(**{"x-api-key": ADMIN})["requests"]
        assert len([row for row in live if (row.get("priority") or 0) >= BACKGROUND_TIER]) <= 2
        assert any(row.get("priority") == 0 for row in live), live  # the interactive one
        # While it decodes, the batch's requests sit out (--background-rows-when-busy 0).
        paused = {row["id"]: row["output_tokens"] for row in background_rows(server)}
        time.sleep(0.3)
        live = server.state(**{"x-api-key": ADMIN})["requests"]
        if any(row.get("priority") == 0 and row["phase"] == "decode" for row in live):
            assert {row["id"]: row["output_tokens"] for row in live
                    if row["id"] in paused} == paused, live
        assert all(row["tenant"] == "alice" and row["background"] for row in rows)
        metrics = httpx.get(server.url + "/metrics", headers={"x-api-key": ADMIN}).text
        assert "tokstream_message_batches_running 1.0" in metrics
        processing = next(line for line in metrics.splitlines() if line.startswith(
            'tokstream_message_batch_requests{state="processing"}'))
        assert float(processing.split()[-1]) >= 4, processing  # six, of which <= 2 ended
        canceling = client.messages.batches.cancel(batch.id)
        assert canceling.processing_status in ("canceling", "ended")
        assert canceling.cancel_initiated_at is not None
        assert sum(1 for _ in interactive.iter_lines()) > 0  # it runs to its end regardless
    batch = ended(client, batch.id)
    counts = batch.request_counts
    assert counts.canceled >= 4 and counts.canceled + counts.succeeded == 6, counts
    results = list(client.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == [f"long-{i}" for i in range(6)]
    assert sum(r.result.type == "canceled" for r in results) == counts.canceled
    server.wait_idle(**{"x-api-key": ADMIN})


@pytest.mark.startup
def test_a_tenants_batch_takes_none_of_its_interactive_limits(server):
    """carol may have one request in flight and 600 tokens a minute: her batch of three
    300-token requests runs outside both, and her own chat beside it is served."""
    client = sdk(server, CAROL)
    batch = client.messages.batches.create(requests=[
        {"custom_id": f"c{i}", "params": params(f"carol {i}", max_tokens=300, ignore_eos=True)}
        for i in range(3)])
    deadline = time.monotonic() + 60
    while not background_rows(server):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    chat = httpx.post(server.url + "/v1/messages", headers={"x-api-key": CAROL},
                      json=params("and a question", max_tokens=8, ignore_eos=True), timeout=60)
    assert chat.status_code == 200, chat.text
    batch = ended(client, batch.id)
    assert batch.request_counts.succeeded == 3, batch.request_counts
    tenant = next(t for t in server.state(**{"x-api-key": ADMIN})["tenants"]
                  if t["name"] == "carol")
    assert tenant["output_tokens"] == 3 * 300 + 8 and tenant["live"] == 0  # still counted


@pytest.mark.startup
def test_a_batch_is_its_tenants_alone_and_lists_newest_first(server):
    alice, bob = sdk(server, ALICE), sdk(server, BOB)
    made = [bob.messages.batches.create(requests=[
        {"custom_id": "one", "params": params(f"batch {i}", max_tokens=2)}]) for i in range(3)]
    for batch in made:
        ended(bob, batch.id)
    newest_first = [batch.id for batch in reversed(made)]
    assert [batch.id for batch in bob.messages.batches.list(limit=2)] == newest_first
    page = bob.messages.batches.list(limit=2)
    assert page.has_more and [b.id for b in page.data] == newest_first[:2]
    assert [b.id for b in bob.messages.batches.list(after_id=newest_first[0])] == \
        newest_first[1:]
    before = httpx.get(server.url + "/v1/messages/batches", headers={"x-api-key": BOB},
                       params={"before_id": newest_first[2], "limit": 1}).json()
    assert [b["id"] for b in before["data"]] == [newest_first[1]] and before["has_more"]
    assert all(b.id not in newest_first for b in alice.messages.batches.list())
    for call in (alice.messages.batches.retrieve, alice.messages.batches.cancel,
                 alice.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError):
            call(made[0].id)
    assert httpx.get(f"{server.url}/v1/messages/batches/{made[0].id}/results",
                     headers={"x-api-key": ALICE}).status_code == 404
    assert httpx.get(server.url + "/v1/messages/batches").status_code == 401


@pytest.mark.startup
def test_bad_batches_and_early_calls_are_400s(server):
    http = httpx.Client(base_url=server.url, headers={"x-api-key": ALICE}, timeout=30)
    one = {"custom_id": "a", "params": params("x")}
    cases = {"requests": {"requests": []},
             "requests.1.custom_id": {"requests": [one, one]},
             "requests.0.custom_id": {"requests": [{**one, "custom_id": "has space"}]},
             "requests.0.params": {"requests": [{"custom_id": "a", "params": "x"}]}}
    for path, body in cases.items():
        response = http.post("/v1/messages/batches", json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["message"].startswith(path + ":"), response.text
    assert http.get("/v1/messages/batches", params={"limit": 0}).status_code == 400
    assert http.get("/v1/messages/batches", params={"after_id": "nope"}).status_code == 400
    batch = http.post("/v1/messages/batches", json={"requests": [
        {"custom_id": "slow", "params": params("x", max_tokens=400, ignore_eos=True)}]}).json()
    early = [http.get(f"/v1/messages/batches/{batch['id']}/results"),
             http.delete(f"/v1/messages/batches/{batch['id']}")]
    assert [r.status_code for r in early] == [400, 400], [r.text for r in early]
    assert "still" in early[0].json()["error"]["message"]
    http.post(f"/v1/messages/batches/{batch['id']}/cancel")
    assert ended(sdk(server, ALICE), batch["id"]).processing_status == "ended"


@pytest.mark.startup
def test_with_a_batch_dir_batches_outlive_the_gateway(tmp_path):
    """--batch-dir: a gateway stopped mid-batch (SIGTERM) leaves it on disk; the next one
    runs the requests that had no result, so every one succeeds once, each what
    /v1/messages gives; an ended batch is kept across the restart; a delete removes it."""
    folder = tmp_path / "batches"
    args = ("--profile", "ci", "--batch-dir", str(folder), "--batch-concurrency", "1")
    bodies = {f"s{i}": params(f"resumed {i}", max_tokens=200, ignore_eos=True, seed=i)
              for i in range(4)}
    with ServerProcess(*args) as first:
        client = sdk(first, "none")
        small = client.messages.batches.create(requests=[
            {"custom_id": "only", "params": params("small", max_tokens=3, seed=9)}])
        ended(client, small.id)
        batch = client.messages.batches.create(requests=[
            {"custom_id": key, "params": body} for key, body in bodies.items()])
        deadline = time.monotonic() + 60
        while client.messages.batches.retrieve(batch.id).request_counts.succeeded < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert oct(os.stat(folder).st_mode & 0o777) == oct(0o700)
    assert oct(os.stat(folder / batch.id / "results.jsonl").st_mode & 0o777) == oct(0o600)
    left = BatchFiles(folder).load()
    assert {b.id: b.processing_status for b in left} == {small.id: "ended",
                                                          batch.id: "in_progress"}
    done_before = next(b for b in left if b.id == batch.id).request_counts()["succeeded"]
    assert 1 <= done_before < 4
    with ServerProcess(*args) as second:
        client = sdk(second, "none")
        assert client.messages.batches.retrieve(small.id).processing_status == "ended"
        finished = ended(client, batch.id)
        assert finished.request_counts.succeeded == 4, finished.request_counts
        each_as_messages_gives(second, client, batch.id, bodies)
        assert [b.id for b in client.messages.batches.list()] == [batch.id, small.id]
        client.messages.batches.delete(small.id)
        assert not (folder / small.id).exists() and (folder / batch.id).exists()


@pytest.mark.startup
def test_a_batch_rides_through_a_rank_death_and_an_engine_core_death():
    """Its requests are resumed like any other: every one succeeds once, each what
    /v1/messages gives the same params afterwards."""
    bodies = {f"k{i}": params(f"through faults {i}", max_tokens=200, ignore_eos=True,
                              seed=20 + i) for i in range(4)}
    with ServerProcess("--profile", "ci", "--tp", "2", "--batch-concurrency", "2") as server:
        client = sdk(server, "none")
        batch = client.messages.batches.create(requests=[
            {"custom_id": key, "params": body} for key, body in bodies.items()])

        def decoded_at_least(tokens: int) -> dict:
            deadline = time.monotonic() + 60
            while True:
                state = server.state()
                rows = [row for row in state["requests"]
                        if (row.get("priority") or 0) >= BACKGROUND_TIER]
                if rows and max(row["output_tokens"] for row in rows) >= tokens:
                    return state
                assert time.monotonic() < deadline, state["requests"]
                time.sleep(0.02)

        kill(decoded_at_least(20)["ranks"][1]["pid"])
        kill(decoded_at_least(60)["engine"]["pid"])
        finished = ended(client, batch.id)
        assert finished.request_counts.succeeded == 4, finished.request_counts
        restarts = server.wait_idle()["replica"]["restarts_by_kind"]
        assert restarts["rank"] >= 1 and restarts["core"] >= 1, restarts
        each_as_messages_gives(server, client, batch.id, bodies)


def test_the_store_tells_of_each_eviction():
    """So that a batch evicted from memory goes from --batch-dir too (batch_runner)."""
    store, seen = ConversationStore(100), []
    store.on_evict = lambda owner, key, record: seen.append((owner, key, record))
    for key in ("k1", "k2", "k3"):
        store.put("a", key, {"x": key * 20})
    assert seen == [("a", "k1", {"x": "k1" * 20})] and store.get("a", "k1") is None


def test_batch_files_leave_out_a_torn_result(tmp_path):
    files = BatchFiles(tmp_path / "b")
    batch = MessageBatch("msgbatch_" + "0" * 24, "alice", [BatchItem("a", {}), BatchItem("b", {})])
    files.create(batch)
    batch.record(batch.items[0], {"type": "errored", "error": {}})
    files.result(batch, 0, batch.items[0].result)
    with open(tmp_path / "b" / batch.id / "results.jsonl", "a") as torn:
        torn.write('{"index": 1, "result": {"ty')  # the crash came mid-line
    (tmp_path / "b" / "msgbatch_unfinished").mkdir()  # no batch.json: never taken up
    (loaded,) = files.load()
    assert loaded.owner == "alice" and [i.custom_id for i in loaded.items] == ["a", "b"]
    assert loaded.items[0].result == {"type": "errored", "error": {}}
    assert loaded.items[1].result is None and loaded.processing_status == "in_progress"


# --- the bookkeeping, without a server ---------------------------------------------------------

def test_counts_always_sum_to_the_batch_and_results_come_once_ended():
    batch = MessageBatch("msgbatch_x", "alice", [BatchItem(f"r{i}", {}) for i in range(4)])
    batch.record(batch.items[0], {"type": "succeeded", "message": {}})
    batch.record(batch.items[1], {"type": "errored", "error": {}})
    assert batch.request_counts() == {"processing": 2, "succeeded": 1, "errored": 1,
                                      "canceled": 0, "expired": 0}
    assert batch.body("URL")["results_url"] is None
    assert batch.body("URL")["processing_status"] == "in_progress"
    batch.cancel_initiated_at = batch.created_at
    assert batch.body("URL")["processing_status"] == "canceling"
    batch.settle_the_rest("canceled")
    body = batch.body("URL")
    assert body["processing_status"] == "ended" and body["results_url"] == "URL"
    assert body["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 1,
                                      "canceled": 2, "expired": 0}
    assert body["created_at"].endswith("Z") and body["expires_at"] > body["created_at"]
    lines = batch.results_jsonl().decode().splitlines()
    assert [line.split('"')[3] for line in lines] == ["r0", "r1", "r2", "r3"]


def test_batch_items_refuse_what_the_api_refuses():
    assert [item.custom_id for item in batch_items(
        {"requests": [{"custom_id": "a-1_B", "params": {}}]})] == ["a-1_B"]
    for body in ({}, {"requests": {}}, {"requests": [1]},
                 {"requests": [{"custom_id": "x" * 65, "params": {}}]},
                 {"requests": [{"custom_id": "a", "params": []}]}):
        with pytest.raises(ApiError) as refused:
            batch_items(body)
        assert refused.value.error_type == "invalid_request_error"
