"""Tenants and auth: keys stored as hashes, 401 for a missing or unknown key, 429 with
retry-after past a concurrency or token-rate limit, admin routes behind the admin key, and the
refusal to expose an open server beyond loopback."""

import asyncio
import subprocess
import sys

import httpx
import pytest

from helpers.serving import ROOT, ServerProcess, anthropic_body, arecord, openai_body
from tokstream.checker import check_streams
from tokstream.server.access.tenants import hash_key, load_tenants
from tokstream.server.submit import cache_salt

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-9876543210", "sk-admin-secret"
METRICS = "sk-prometheus-scraper"
CAROL = "sk-carol-counts-tokens"


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(f"""
admin_key_sha256 = "{hash_key(ADMIN)}"
metrics_key_sha256 = "{hash_key(METRICS)}"

[[tenant]]
name = "alice"
key_sha256 = "{hash_key(ALICE)}"
weight = 2.0
max_concurrent = 1

[[tenant]]
name = "bob"
key_sha256 = "{hash_key(BOB)}"
priority = 1
tokens_per_minute = 60

[[tenant]]
name = "carol"
key_sha256 = "{hash_key(CAROL)}"
tokens_per_minute = 200
""")
    return path


@pytest.fixture(scope="module")
def server(tenants_file):
    with ServerProcess("--profile", "ci", "--tenants", str(tenants_file)) as server:
        yield server


def test_file_holds_only_hashes(tenants_file):
    text = tenants_file.read_text()
    assert ALICE not in text and BOB not in text and ADMIN not in text
    tenants = load_tenants(tenants_file)
    assert [t.name for t in tenants.tenants] == ["alice", "bob", "carol"]
    assert tenants.authenticate(ALICE).name == "alice"


def test_missing_or_unknown_key_is_401(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for headers in ({}, {"x-api-key": "sk-wrong"}, {"authorization": "Bearer sk-wrong"}):
            response = client.post("/v1/messages", json=anthropic_body(stream=False),
                                   headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        response = client.post("/v1/chat/completions", json=openai_body(stream=False))
        assert response.status_code == 401 and "error" in response.json()
        assert client.get("/v1/models").status_code == 401
        assert client.get("/health").status_code == 200  # probes need no key
        ok = client.post("/v1/chat/completions", json=openai_body(max_tokens=3, stream=False),
                         headers={"authorization": f"Bearer {ALICE}"})
        assert ok.status_code == 200


def test_concurrency_limit_is_429_with_retry_after(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            headers = {"x-api-key": ALICE}
            first = asyncio.ensure_future(arecord(client, "/v1/messages", anthropic_body(
                max_tokens=200, ignore_eos=True), headers))
            for _ in range(200):
                state = (await client.get("/v1/state", headers={"x-api-key": ADMIN})).json()
                if state["requests"]:
                    break
                await asyncio.sleep(0.05)
            second = await client.post("/v1/messages", json=anthropic_body(stream=False),
                                       headers=headers)
            return second, await first, state

    second, first, state = asyncio.run(scenario())
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert int(second.headers["retry-after"]) >= 1
    assert check_streams([first]).ok
    assert state["requests"][0]["tenant"] == "alice"
    alice = next(t for t in state["tenants"] if t["name"] == "alice")
    assert alice["live"] == 1 and alice["weight"] == 2.0


def test_token_rate_limit_is_429_with_retry_after(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        headers = {"x-api-key": BOB}
        codes = []
        for _ in range(4):
            response = client.post("/v1/messages", json=anthropic_body(
                "w " * 10, max_tokens=16, stream=False, ignore_eos=True), headers=headers)
            codes.append(response.status_code)
            if response.status_code == 429:
                break
        assert codes[0] == 200 and codes[-1] == 429, codes
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert "tokens per minute" in response.json()["error"]["message"]
        assert int(response.headers["retry-after"]) >= 1
        # Alice is not affected by Bob's limit.
        ok = client.post("/v1/messages", json=anthropic_body(max_tokens=2, stream=False),
                         headers={"x-api-key": ALICE})
        assert ok.status_code == 200
        metrics = client.get("/metrics", headers={"authorization": f"Bearer {METRICS}"}).text
        assert 'tokstream_tenant_tokens_total{kind="prompt",tenant="bob"}' in metrics


def test_admin_routes_need_the_admin_key(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/v1/state").status_code == 401
        forbidden = client.get("/v1/state", headers={"x-api-key": ALICE})
        assert forbidden.status_code == 403
        assert forbidden.json()["error"]["type"] == "permission_error"
        assert client.post("/v1/score", json={"token_ids": [1, 2, 3]},
                           headers={"x-api-key": BOB}).status_code == 403
        assert client.get("/v1/state/requests/x", headers={"x-api-key": ALICE}).status_code == 403
        assert client.get("/v1/state", headers={"x-api-key": ADMIN}).status_code == 200
        scored = client.post("/v1/score", json={"token_ids": [5, 6, 7, 8]},
                             headers={"authorization": f"Bearer {ADMIN}"})
        assert scored.status_code == 200 and len(scored.json()["positions"]) == 3


def test_open_server_refuses_a_public_bind_without_insecure():
    result = subprocess.run([sys.executable, "-m", "tokstream", "serve", "--profile", "ci",
                             "--host", "0.0.0.0", "--port", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--insecure" in result.stderr and "Traceback" not in result.stderr


def test_bad_tenants_file_is_a_clean_error(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenant]]\nname = "x"\nkey_sha256 = "not-a-hash"\n')
    result = subprocess.run([sys.executable, "-m", "tokstream", "serve", "--profile", "ci",
                             "--tenants", str(path), "--port", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "key_sha256" in result.stderr and "Traceback" not in result.stderr


def test_metrics_need_the_admin_or_the_metrics_key(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"x-api-key": ALICE}).status_code == 403
        for key in (ADMIN, METRICS):
            response = client.get("/metrics", headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200 and "vllm:num_requests_running" in response.text
        # The metrics key opens nothing else.
        assert client.get("/v1/state", headers={"x-api-key": METRICS}).status_code == 403


def test_count_tokens_is_charged_to_the_tenant(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"model": "dummy:tiny", "messages": [{"role": "user", "content": "w " * 20}]}
        codes = []
        for _ in range(20):
            response = client.post("/v1/messages/count_tokens", json=body,
                                   headers={"x-api-key": CAROL})
            codes.append(response.status_code)
            if response.status_code == 429:
                break
        assert codes[0] == 200 and codes[-1] == 429, codes
        assert response.json()["error"]["type"] == "rate_limit_error"


def test_stored_responses_are_their_tenants_own(server):
    def call(method, path, key, **kwargs):
        return httpx.request(method, server.url + path, timeout=30,
                             headers={"authorization": f"Bearer {key}"}, **kwargs)

    made = call("POST", "/v1/responses", ALICE, json={
        "model": "dummy:tiny", "input": "hi", "max_output_tokens": 2})
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    assert call("GET", f"/v1/responses/{response_id}", ALICE).status_code == 200
    for path in (f"/v1/responses/{response_id}", f"/v1/responses/{response_id}/input_items"):
        assert call("GET", path, CAROL).status_code == 404
    assert call("DELETE", f"/v1/responses/{response_id}", CAROL).status_code == 404
    continued = call("POST", "/v1/responses", CAROL, json={
        "model": "dummy:tiny", "input": "and?", "max_output_tokens": 2,
        "previous_response_id": response_id})
    assert continued.status_code == 404 and continued.json()["error"]["param"] == \
        "previous_response_id"
    assert call("GET", f"/v1/responses/{response_id}", "sk-nobody").status_code == 401
    assert call("DELETE", f"/v1/responses/{response_id}", ALICE).json()["deleted"] is True
    assert call("GET", f"/v1/responses/{response_id}", ALICE).status_code == 404


def test_a_callers_cache_salt_narrows_sharing_within_its_tenant(server):
    """vLLM's cache_salt: the same prompt is served from the cache only to requests of the
    same tenant with the same salt (full blocks of 4 of a 40-token prompt: 36 cached)."""
    prompt = [(17 + i * 29) % 500 for i in range(40)]

    def cached(key: str, **salt) -> int:
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "dummy:tiny", "prompt": prompt, "max_tokens": 1, **salt},
            headers={"authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(ALICE, cache_salt="user-1") == 0
    assert cached(ALICE, cache_salt="user-1") == 36
    assert cached(ALICE, cache_salt="user-2") == 0
    assert cached(ALICE) == 0  # the tenant's salt alone is another
    assert cached(ALICE) == 36
    for bad in ("", 5, "x" * 257):
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "dummy:tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": bad},
            headers={"authorization": f"Bearer {ALICE}"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt"


def test_salts_stay_apart_however_the_names_read():
    assert cache_salt("alice", "") == "alice"
    assert cache_salt("a:b", "c") != cache_salt("a", "b:c")
    assert cache_salt("alice", "u") not in ("alice", "u")
