"""The gateway against hostile and careless clients (issue 15), on one dummy:tiny server:
lone surrogates are 400s naming the field, a body cut short is a disconnect, only declared JSON
is read, foreign Host names are refused (DNS rebinding), CORS preflights are answered for the
configured origins only, the prefix-cache counters are real, and error messages stay short
whatever the client sent."""

import json
import re
import socket
import time

import httpx
import pytest

from helpers.serving import ServerProcess, anthropic_body, openai_body

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--profile", "ci", "--allowed-hosts", "api.example,.corp.example",
                       "--allowed-origins", ORIGIN) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def metric(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                                     text, re.M)]
    return sum(values)


SURROGATE = "\\ud800"  # valid JSON, but no Unicode text: it cannot be encoded or tokenised


@pytest.mark.parametrize("path, raw, field", [
    ("/v1/messages", '{"model":"dummy:tiny","max_tokens":4,"messages":[{"role":"user",'
                     f'"content":"a{SURROGATE}"}}]}}', "messages.0.content"),
    ("/v1/messages", '{"model":"dummy:tiny","max_tokens":4,"system":"' + SURROGATE + '",'
                     '"messages":[{"role":"user","content":"hi"}]}', "system"),
    ("/v1/messages/count_tokens", '{"model":"dummy:tiny","messages":[{"role":"user",'
                                  f'"content":[{{"type":"text","text":"{SURROGATE}"}}]}}]}}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", '{"model":"dummy:tiny","max_tokens":4,"messages":[{"role":"user",'
                             f'"content":"{SURROGATE}x"}}]}}', "messages.0.content"),
    ("/v1/completions", f'{{"model":"dummy:tiny","max_tokens":4,"prompt":"{SURROGATE}"}}',
     "prompt"),
    ("/v1/messages", '{"model":"dummy:tiny","max_tokens":4,"stop_sequences":["' + SURROGATE
     + '"],"messages":[{"role":"user","content":"hi"}]}', "stop_sequences.0"),
])
def test_lone_surrogate_is_400_naming_the_field(client, path, raw, field):
    response = client.post(path, content=raw.encode(),
                           headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}:"), error


def test_body_cut_short_is_a_disconnect_not_an_error(server, client):
    before = metric(client.get("/metrics").text, "tokstream_errors_total")
    host, port = server.host_port
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens"):
        with socket.create_connection((host, port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                         "application/json\r\nContent-Length: 100\r\n\r\n{\"mo".encode())
        time.sleep(0.2)
    assert client.get("/health").status_code == 200
    after = metric(client.get("/metrics").text, "tokstream_errors_total")
    assert after == before
    assert not any("Traceback" in line or "unhandled error" in line for line in server.log)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_only_declared_json_is_read(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens"):
        response = client.post(path, content=json.dumps(anthropic_body(stream=False)).encode(),
                               headers=headers)
        assert response.status_code == 415, (path, content_type, response.text)
        assert "content-type" in response.json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json=openai_body(max_tokens=2, stream=False),
                     headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_foreign_host_names_are_refused(server, client):
    host, port = server.host_port
    for path, method in (("/v1/state", "GET"), ("/v1/messages", "POST"), ("/metrics", "GET")):
        response = client.request(method, path, headers={"host": "evil.example"},
                                  json=anthropic_body(stream=False))
        assert response.status_code == 403, (path, response.text)
        assert "Host" in response.json()["error"]["message"]
    for name in (f"localhost:{port}", f"127.0.0.1:{port}", "api.example", "x.corp.example:80",
                 "[::1]:8000", "10.1.2.3:8000", "localhost"):
        assert client.get("/v1/state", headers={"host": name}).status_code == 200, name
    assert client.get("/health", headers={"host": "corp.example.evil"}).status_code == 403


def test_cors_preflight_for_configured_origins_only(client):
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type,x-api-key,anthropic-version"}
    response = client.options("/v1/messages", headers=preflight)
    assert response.status_code in (200, 204), response.text
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "x-api-key" in response.headers["access-control-allow-headers"].lower()
    refused = client.options("/v1/messages", headers={**preflight, "origin": "https://evil.example"})
    assert refused.status_code >= 400
    assert "access-control-allow-origin" not in refused.headers
    # A real request from the allowed origin is readable by its page; another origin's is not.
    ok = client.post("/v1/messages", json=anthropic_body(max_tokens=2, stream=False),
                     headers={"origin": ORIGIN})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = client.get("/v1/models", headers={"origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_prefix_cache_counters_are_real(server, client):
    prompt = [7, 8, 9, 10] * 8
    for _ in range(2):
        response = client.post("/v1/completions", json={"model": "dummy:tiny", "prompt": prompt,
                                                        "max_tokens": 2})
        assert response.status_code == 200
    server.wait_idle()
    kv = server.state()["kv"]
    text = client.get("/metrics").text
    assert kv["prefix_cache_hits"] > 0
    assert metric(text, "vllm:prefix_cache_hits_total") == kv["prefix_cache_hits"]
    assert metric(text, "vllm:prefix_cache_queries_total") == kv["prefix_cache_queries"]


def test_error_messages_do_not_echo_huge_values(client):
    huge = "x" * 200_000
    cases = [
        ("/v1/messages", {**anthropic_body(stream=False), "model": huge}),
        ("/v1/messages", anthropic_body(stream=False, messages=[{"role": huge, "content": "a"}])),
        ("/v1/chat/completions", openai_body(stream=False, messages=[{"role": huge,
                                                                       "content": "a"}])),
        ("/v1/messages", anthropic_body(stream=False, messages=[{"role": "user", "content": [
            {"type": huge, "text": "a"}]}])),
        ("/v1/completions", {"model": "dummy:tiny", "prompt": "a", "max_tokens": int("9" * 4000)}),
        ("/v1/" + "p" * 8000, {}),
    ]
    for path, body in cases:
        response = client.post(path, json=body)
        assert 400 <= response.status_code < 500, response.text[:200]
        assert len(response.json()["error"]["message"]) < 500, (path, response.text[:200])


def test_stop_strings_are_bounded(client):
    response = client.post("/v1/messages", json=anthropic_body(
        stream=False, stop_sequences=["s" * 100_000]))
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("stop_sequences.0:")
    response = client.post("/v1/chat/completions", json=openai_body(stream=False,
                                                                    stop=["ok", "t" * 5000]))
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("stop.1:")
