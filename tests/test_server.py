"""`tokstream serve` on dummy:tiny, end to end over HTTP: SSE event order and framing on both
APIs, the integrity extension, non-streaming bodies, exact usage, typed errors naming the
field, the admin routes, metrics and the published schema."""

import json
import re

import httpx
import pytest

from helpers.serving import (INTEGRITY, ServerProcess, anthropic_body, module_server,
                             openai_body, record)
from tokstream.checker import check_streams
from tokstream.server.app import routes
from tokstream.engine.messages.request import token_digest

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]


server = module_server("--profile", "ci")


@pytest.fixture(scope="module")
def client(server):
    # The integrity framing (id: lines) is what these tests read; stock framing is tested
    # in test_stock_framing_by_default.
    with httpx.Client(base_url=server.url, timeout=60, headers=INTEGRITY) as client:
        yield client


def test_anthropic_stream_event_order_and_framing(client):
    response, stream = record(client, "/v1/messages", anthropic_body(max_tokens=12,
                                                                     ignore_eos=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [e.event for e in stream.events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"}
    for event in stream.events:
        data = event.json()
        assert data["type"] == event.event  # the JSON's type equals the event name
        if event.event == "content_block_delta":
            assert event.id is not None and int(event.id) == data["tokstream"]["indices"][-1]
    start = stream.events[0].json()["message"]
    assert start["id"].startswith("msg_") and start["usage"]["output_tokens"] == 0
    delta = stream.events[-2].json()
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 12
    split = delta["usage"]  # message_start counts the whole prompt; the end splits it
    assert split["input_tokens"] + split["cache_read_input_tokens"] \
        + split["cache_creation_input_tokens"] == start["usage"]["input_tokens"]
    report = check_streams([stream])
    assert report.ok, report.summary()
    assert len(report.streams[0].token_ids) == 12


def test_openai_chat_stream_with_usage_and_done(client):
    body = openai_body(max_tokens=10, ignore_eos=True, stream_options={"include_usage": True})
    response, stream = record(client, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert all(e.event is None for e in stream.events)
    assert stream.events[-1].data == "[DONE]"
    chunks = [e.json() for e in stream.events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 10
    assert usage_chunk["usage"]["total_tokens"] == 10 + usage_chunk["usage"]["prompt_tokens"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    report = check_streams([stream])
    assert report.ok, report.summary()


def test_openai_completions_stream_and_token_prompt(client):
    body = {"model": "dummy:tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "stream": True,
            "ignore_eos": True}
    _, stream = record(client, "/v1/completions", body)
    assert stream.events[-1].data == "[DONE]"
    chunks = [e.json() for e in stream.events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "usage" not in chunks[0]  # only with stream_options.include_usage
    report = check_streams([stream])
    assert report.ok and len(report.streams[0].token_ids) == 6


def test_non_streaming_bodies_match_streams(client):
    body = anthropic_body("same prompt", max_tokens=8, stream=False, temperature=0,
                          ignore_eos=True)
    message = client.post("/v1/messages", json=body).json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"]["output_tokens"] == 8 == len(message["tokstream"]["token_ids"])
    assert message["tokstream"]["digest"] == token_digest(message["tokstream"]["token_ids"])
    _, stream = record(client, "/v1/messages", {**body, "stream": True})
    report = check_streams([stream]).streams[0]
    assert report.token_ids == message["tokstream"]["token_ids"]
    assert report.text == message["content"][0]["text"]

    chat = client.post("/v1/chat/completions", json=openai_body(
        "same prompt", max_tokens=8, stream=False, temperature=0, ignore_eos=True)).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 8
    # The same greedy request through either API gives the same tokens.
    assert chat["tokstream"]["token_ids"] == message["tokstream"]["token_ids"]


def test_stop_sequence_is_reported(client):
    free = client.post("/v1/messages", json=anthropic_body(
        "stop test", max_tokens=12, stream=False, temperature=0, ignore_eos=True)).json()
    text = free["content"][0]["text"]
    word = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if "\ufffd" not in text[i:i + 2])
    stopped = client.post("/v1/messages", json=anthropic_body(
        "stop test", max_tokens=12, stream=False, temperature=0, ignore_eos=True,
        stop_sequences=[word])).json()
    assert stopped["stop_reason"] == "stop_sequence"
    assert stopped["stop_sequence"] == word
    assert stopped["content"][0]["text"] == text[:text.index(word)]


def test_count_tokens_models_health(client):
    body = {"model": "dummy:tiny", "messages": [{"role": "user", "content": "hello"}]}
    counted = client.post("/v1/messages/count_tokens", json=body).json()
    message = client.post("/v1/messages", json={**body, "max_tokens": 1}).json()
    usage = message["usage"]  # the prompt, split as the Messages API splits it
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] \
        + usage["cache_creation_input_tokens"] > 0
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["dummy:tiny"]
    assert client.get("/health").json() == {"status": "ready"}


BAD_MESSAGES = [
    (b"{not json", "body"),
    (b"\xff\xfe{}", "body"),
    (b"[1, 2]", "body"),
    ({"model": "dummy:tiny", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (anthropic_body(max_tokens=0), "max_tokens"),
    (anthropic_body(max_tokens="ten"), "max_tokens"),
    (anthropic_body(max_tokens=10**9), "max_tokens"),
    (anthropic_body(temperature=1.5), "temperature"),
    (anthropic_body(temperature="hot"), "temperature"),
    (anthropic_body(top_p=0), "top_p"),
    (anthropic_body(top_k=-2), "top_k"),
    (anthropic_body(stop_sequences=[""]), "stop_sequences.0"),
    (anthropic_body(stop_sequences="END"), "stop_sequences"),
    ({**anthropic_body(), "messages": []}, "messages"),
    ({**anthropic_body(), "messages": "hi"}, "messages"),
    ({**anthropic_body(), "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({**anthropic_body(), "messages": [{"role": "user"}]}, "messages.0.content"),
    ({**anthropic_body(), "messages": [{"role": "user", "content": ""}]}, "messages.0.content"),
    ({**anthropic_body(), "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.type"),
    ({**anthropic_body(), "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (anthropic_body(content="w " * 3000), "messages"),
    (anthropic_body(stream="yes"), "stream"),
    (anthropic_body(system=5), "system"),
    (anthropic_body(metadata="x"), "metadata"),
    (anthropic_body(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (anthropic_body(mcp_servers=[{"type": "url", "url": "https://mcp.example",
                                  "name": "x"}]), "mcp_servers"),
    (anthropic_body(container="container_1"), "container"),
]


@pytest.mark.parametrize("body, field", BAD_MESSAGES)
def test_bad_input_is_a_typed_400_naming_the_field(client, body, field):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/v1/messages", content=content,
                           headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field + ":"), error


@pytest.mark.parametrize("body, field", [
    (openai_body(temperature=2.5), "temperature"),
    (openai_body(n=17), "n"),
    (openai_body(logprobs=True, top_logprobs=99), "top_logprobs"),
    ({**openai_body(), "messages": [{"role": "tool", "content": "x"}]},
     "messages.0.tool_call_id"),
    (openai_body(max_tokens=-1), "max_tokens"),
    (openai_body(seed=-1), "seed"),
])
def test_openai_bad_input_uses_the_openai_error_shape(client, body, field):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field
    assert error["message"].startswith(field + ":")


def test_unknown_model_size_limit_and_routes(client):
    response = client.post("/v1/messages", json={**anthropic_body(), "model": "claude-x"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    response = client.post("/v1/chat/completions", json={**openai_body(), "model": "gpt-x"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    big = anthropic_body(content="x" * (5 * 2**20))
    response = client.post("/v1/messages", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    assert client.get("/v1/nope").status_code == 404
    assert client.get("/v1/messages").json()["error"]["type"] == "method_not_allowed"
    # None of that reached or harmed the engine.
    assert client.get("/health").status_code == 200


def test_openapi_schema_lists_every_route(client):
    schema = client.get("/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    served = {(re.sub(r":\w+}", "}", route.path), method.lower())  # {id:path} -> {id}
              for route in routes() for method in route.methods if method != "HEAD"}
    listed = {(path, method) for path, item in schema["paths"].items() for method in item
              if method != "parameters"}
    assert served == listed
    body = schema["paths"]["/v1/messages"]["post"]["requestBody"]
    assert "max_tokens" in body["content"]["application/json"]["schema"]["required"]


def test_metrics_use_vllm_names(client):
    client.post("/v1/messages", json=anthropic_body(max_tokens=4, stream=False))
    text = client.get("/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_preemptions_total", "tokstream_kv_blocks",
                 "tokstream_errors_total", "tokstream_replica_status"):
        assert name in text, name
    generated = [line for line in text.splitlines()
                 if line.startswith("vllm:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 4


def test_state_snapshot_and_one_request(server, client):
    with client.stream("POST", "/v1/messages", json=anthropic_body(
            max_tokens=1500, ignore_eos=True)) as response:
        lines = response.iter_lines()
        request_id = None
        for line in lines:
            if line.startswith("data:") and request_id is None:
                request_id = json.loads(line[5:])["message"]["id"]
            if line.startswith("id: 3"):
                break
        state = client.get("/v1/state").json()
        one = client.get(f"/v1/state/requests/{request_id}").json()
    assert state["replica"]["status"] == "ready"
    assert state["ranks"][0]["alive"] and state["engine"]["alive"]
    assert state["gateway"]["pid"] != state["engine"]["pid"]
    rows = {r["id"]: r for r in state["requests"]}
    assert rows[request_id]["state"] == "running" and rows[request_id]["blocks"] > 0
    assert rows[request_id]["ttft_ms"] is not None
    kv = state["kv"]
    assert kv["used_blocks"] + kv["free_blocks"] == kv["num_blocks"] == len(
        kv["block_map"]["ref_counts"])
    owned = sum(n for run in kv["block_map"]["owners"][request_id] for n in run[1:])
    assert owned == rows[request_id]["blocks"]
    for key in ("running", "waiting", "max_num_seqs", "last_step_tokens", "token_budget"):
        assert key in state["batch"]
    assert state["memory"]["processes"][0]["rss_bytes"] > 0
    assert one["id"] == request_id and one["recent_text"]
    assert client.get("/v1/state/requests/msg_nope").status_code == 404
    server.wait_idle()


def test_score_greedy_tokens_are_the_argmax(client):
    prompt = [7, 8, 9, 10, 11]
    completion = client.post("/v1/completions", json={
        "model": "dummy:tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True}).json()
    tokens = completion["tokstream"]["token_ids"]
    scored = client.post("/v1/score", json={"prompt_token_ids": prompt,
                                            "output_token_ids": tokens}).json()
    assert [p["token_id"] for p in scored["positions"]] == tokens
    assert [p["position"] for p in scored["positions"]] == list(range(5, 15))
    for position in scored["positions"]:
        # Teacher-forced logits reproduce the greedy choice (float32).
        assert position["top_logit"] - position["logit"] < 1e-4
    bad = client.post("/v1/score", json={"token_ids": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("token_ids")


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", "openai"),
                                       ("/v1/messages", "anthropic")])
def test_stock_framing_by_default(path, body):
    """Without x-tokstream-integrity, a stream is framed as the API it imitates: no id: lines
    (and no comment pings on OpenAI routes), as vllm bench serve and GuideLLM parse it."""
    payload = (openai_body(stream=True, max_tokens=6) if body == "openai"
               else anthropic_body(stream=True, max_tokens=6))
    with ServerProcess("--profile", "ci", "--no-stream-integrity", "--ping-interval", "0.05") \
            as server, httpx.Client(base_url=server.url, timeout=60) as plain:
        text = plain.post(path, json=payload).text
        with_integrity = plain.post(path, json=payload, headers=INTEGRITY).text
    lines = [line for line in text.splitlines() if line]
    assert not any(line.startswith(("id:", ":")) for line in lines)
    if body == "openai":
        assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    else:
        assert all(line.startswith(("event: ", "data: ")) for line in lines)
    assert any(line.startswith("id: ") for line in with_integrity.splitlines())


def test_models_listed_and_retrieved_by_both_sdks(server):
    import anthropic
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as gpt:
        assert [m.id for m in gpt.models.list()] == ["dummy:tiny"]
        model = gpt.models.retrieve("dummy:tiny")
        assert model.id == "dummy:tiny" and model.object == "model"
        with pytest.raises(openai.NotFoundError):
            gpt.models.retrieve("gpt-4o")
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as claude:
        [listed] = claude.models.list().data
        assert listed.id == "dummy:tiny" and listed.type == "model"
        assert listed.created_at.year >= 2026  # an RFC 3339 time the SDK parses
        assert claude.models.retrieve("dummy:tiny").display_name == "dummy:tiny"
        with pytest.raises(anthropic.NotFoundError):
            claude.models.retrieve("claude-opus-4")
