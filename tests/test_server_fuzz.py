"""Fuzzing every POST endpoint with hypothesis: bodies mixing valid fields and junk, and raw
bytes. Nothing may produce a 5xx, a streamed answer always ends explicitly, and the server is
healthy and correct afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import ServerProcess, anthropic_body, record
from tokstream.checker import check_streams, parse_sse

pytestmark = pytest.mark.timeout(600)

FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
           | st.text(max_size=20))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
small_tokens = st.integers(-2, 6)
text = st.text(max_size=30)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"])
                                 | junk,
                                 "content": text | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image"]),
                                      "text": text}), max_size=2) | junk})


def maybe(strategy):
    return st.one_of(st.just(None), strategy, junk)


def body(**fields):
    """A dict whose fields are each absent, valid-looking or junk."""
    return st.fixed_dictionaries({}, optional={k: v for k, v in fields.items()}).map(
        lambda d: {k: v for k, v in d.items()})


common = dict(model=st.sampled_from(["dummy:tiny", "other"]) | junk,
              max_tokens=small_tokens | junk, temperature=st.floats(-1, 3) | junk,
              top_p=st.floats(-1, 2) | junk, top_k=st.integers(-3, 100) | junk,
              seed=st.integers(-5, 2**64) | junk, stream=st.booleans() | junk,
              ignore_eos=st.booleans() | junk)
ANTHROPIC = body(messages=st.lists(message, max_size=3) | junk, system=text | junk,
                 stop_sequences=st.lists(text, max_size=2) | junk, metadata=junk, **common)
CHAT = body(messages=st.lists(message, max_size=3) | junk, stop=text | junk,
            n=st.integers(0, 2) | junk, stream_options=junk, logprobs=junk, **common)
COMPLETION = body(prompt=text | st.lists(st.integers(-5, 600), max_size=8) | junk,
                  stop=text | junk, echo=junk, **common)
COUNT = body(model=common["model"], messages=st.lists(message, max_size=3) | junk, system=junk)
SCORE = body(token_ids=st.lists(st.integers(-5, 600), max_size=12) | junk,
             start=st.integers(-2, 12) | junk, prompt_token_ids=junk, output_token_ids=junk)


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--profile", "ci") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def post(client, path: str, content: bytes) -> httpx.Response:
    with client.stream("POST", path, content=content,
                       headers={"content-type": "application/json"}) as response:
        response.read()
    assert response.status_code < 500, (path, content[:300], response.text[:300])
    if response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"):
        report = check_streams([type_stream(response.content)])
        assert report.streams[0].status in ("complete", "failed"), report.summary()
    elif response.status_code >= 400:
        error = response.json()
        assert "error" in error and error["error"]["message"]
    return response


def type_stream(content: bytes):
    from tokstream.checker import RecordedStream
    return RecordedStream(parse_sse(content))


@pytest.mark.parametrize("path, strategy", [
    ("/v1/messages", ANTHROPIC), ("/v1/chat/completions", CHAT),
    ("/v1/completions", COMPLETION), ("/v1/messages/count_tokens", COUNT),
    ("/v1/score", SCORE),
])
def test_fuzzed_bodies_never_5xx(client, path, strategy):
    @FUZZ
    @given(strategy)
    def run(fields):
        try:
            content = json.dumps(fields).encode()
        except (ValueError, OverflowError):
            return
        post(client, path, content)

    run()


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_raw_bytes_never_5xx(client, raw):
    for path in ("/v1/messages", "/v1/chat/completions"):
        response = post(client, path, raw)
        assert response.status_code in (200, 400, 404), response.text


def test_healthy_and_correct_after_fuzzing(server, client):
    assert client.get("/health").status_code == 200
    _, stream = record(client, "/v1/messages", anthropic_body(max_tokens=6, ignore_eos=True))
    report = check_streams([stream])
    assert report.ok and len(report.streams[0].token_ids) == 6
    server.wait_idle()
