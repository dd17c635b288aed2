"""Fuzzing every POST endpoint with hypothesis: bodies mixing valid fields and junk (tool
histories among them: calls without content, arguments that are no JSON or nest deep, results,
tools and tool_choice), and raw bytes; and whole requests on every route (methods, paths, query strings, Host, Origin and
content-type headers, lone surrogates). Nothing may produce a 5xx, a streamed answer always ends
explicitly, and the server is healthy, idle and leak-free afterwards. bench/fuzz_gateway.py
sends 10,000+ of the same requests (REQUESTS) and writes bench/results/fuzz_gateway.json."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.serving import anthropic_body, module_server, record
from tokstream.checker import check_streams, parse_sse

pytestmark = [pytest.mark.startup, pytest.mark.timeout(600)]

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
names = st.sampled_from(["get_weather", "f", "a b", ""]) | junk
odd_arguments = st.sampled_from(['{"city": "Par', "", "{}", "null", "[1]", '"\\ud800"',
                                 '{"a": "\\q"}', '{"a": ' * 1200, "{" * 3]) | text | junk
"""A past call's arguments: cut, empty, not an object, a lone surrogate, an invalid escape,
nested past the JSON decoder's recursion limit, any text, not a string."""
schema = st.sampled_from([{"type": "object", "properties": {"city": {"type": "string"}}},
                          {"type": "nope"}, {}]) | junk
openai_call = st.fixed_dictionaries({"id": st.text(max_size=6) | junk, "type": st.just(
    "function") | junk, "function": st.fixed_dictionaries(
        {"name": names, "arguments": odd_arguments}) | junk})
openai_tool_turn = st.fixed_dictionaries(
    {"role": st.just("assistant"), "tool_calls": st.lists(openai_call, max_size=2) | junk},
    optional={"content": st.none() | text}) | st.fixed_dictionaries(
    {"role": st.just("tool"), "content": text | junk},
    optional={"tool_call_id": st.text(max_size=6) | junk})
anthropic_tool_turn = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.lists(
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=6) | junk,
                           "name": names, "input": st.dictionaries(st.text(max_size=4), text,
                                                                   max_size=2) | junk})
    | st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)}) \
    | st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("tool_result"),
                               "tool_use_id": st.text(max_size=6) | junk,
                               "content": text | junk}, optional={"is_error": junk}),
        max_size=2)})
ASK = {"role": "user", "content": "Weather in Paris?"}
openai_history = st.tuples(
    st.lists(st.fixed_dictionaries({"id": st.just("call_1"), "type": st.just("function"),
                                    "function": st.fixed_dictionaries(
                                        {"name": st.just("f"), "arguments": odd_arguments})}),
             min_size=1, max_size=2),
    st.sampled_from([None, "", "Checking."]), st.booleans()).map(lambda t: [
        ASK, {"role": "assistant", "tool_calls": t[0], **({} if t[1] is None else {
            "content": t[1]})},
        *([{"role": "tool", "tool_call_id": "call_1", "content": "21 C"}] if t[2] else [])])
"""A well-formed history around odd arguments, with or without content and a result."""
anthropic_history = st.tuples(
    st.dictionaries(st.text(max_size=4), text | junk, max_size=2), st.booleans()).map(
    lambda t: [ASK, {"role": "assistant", "content": [
        *([{"type": "text", "text": "Checking."}] if t[1] else []),
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": t[0]}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "21 C"}]}])
openai_messages = st.lists(message, max_size=3) | junk | openai_history | st.lists(
    openai_tool_turn, max_size=3).map(lambda turns: [ASK, *turns])
anthropic_messages = st.lists(message, max_size=3) | junk | anthropic_history | st.lists(
    anthropic_tool_turn, max_size=3).map(lambda turns: [ASK, *turns])
openai_tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | junk,
                                               "function": st.fixed_dictionaries(
                                                   {"name": names, "parameters": schema})}),
                        max_size=2) | junk
anthropic_tools = st.lists(st.fixed_dictionaries({"name": names, "input_schema": schema}),
                           max_size=2) | junk
openai_choice = st.sampled_from(["auto", "none", "required"]) | junk | st.just(
    {"type": "function", "function": {"name": "f"}})
anthropic_choice = st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                    {"type": "tool", "name": "f"}]) | junk
responses_item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                             "item_reference"]) | junk,
    "role": st.sampled_from(["user", "assistant", "developer", "tool"]) | junk,
    "content": text | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image"]) | junk,
         "text": text | junk}), max_size=2) | junk,
    "call_id": st.just("call_1") | junk, "name": names, "arguments": odd_arguments,
    "output": text | junk})
responses_input = text | st.lists(responses_item, max_size=3) | junk | st.lists(
    responses_item, max_size=3).map(lambda items: [ASK, *items])
responses_tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | junk,
                                                  "name": names, "parameters": schema}),
                           max_size=2) | junk
responses_choice = st.sampled_from(["auto", "none", "required"]) | junk | st.just(
    {"type": "function", "name": "f"})
responses_text = st.fixed_dictionaries({"format": st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema"]) | junk,
     "name": st.just("x") | junk, "schema": schema}) | junk}) | junk


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
output_format = st.fixed_dictionaries({"type": st.just("json_schema") | junk,
                                       "schema": schema}) | junk
ANTHROPIC = body(messages=anthropic_messages, system=text | junk,
                 stop_sequences=st.lists(text, max_size=2) | junk, metadata=junk,
                 tools=anthropic_tools, tool_choice=anthropic_choice,
                 output_config=st.fixed_dictionaries({}, optional={
                     "format": output_format, "effort": st.just("high") | junk}) | junk,
                 output_format=output_format, thread=junk | st.sampled_from([
                     {"type": "create"}, {"type": "continue", "previous_message_id": "msg_x"}]),
                 **common)
CHAT = body(messages=openai_messages, stop=text | junk,
            n=st.integers(0, 2) | junk, stream_options=junk, logprobs=junk,
            tools=openai_tools, tool_choice=openai_choice, **common)
token_ids = st.lists(st.integers(-5, 600), max_size=8)
COMPLETION = body(prompt=text | token_ids | st.lists(text | token_ids | junk, max_size=4) | junk,
                  n=st.integers(0, 3) | junk, stop=text | junk, echo=junk, **common)
COUNT = body(model=common["model"], messages=anthropic_messages, system=junk,
             tools=anthropic_tools)
TOKENIZE = body(model=common["model"], messages=openai_messages, prompt=text | junk,
                add_generation_prompt=st.booleans() | junk,
                add_special_tokens=st.booleans() | junk, tools=openai_tools)
DETOKENIZE = body(model=common["model"], tokens=st.lists(st.integers(-5, 600), max_size=8)
                  | junk)
RESPONSES = body(model=common["model"], input=responses_input, instructions=text | junk,
                 max_output_tokens=small_tokens | junk, temperature=common["temperature"],
                 top_p=common["top_p"], seed=common["seed"], stream=common["stream"],
                 tools=responses_tools, tool_choice=responses_choice,
                 parallel_tool_calls=junk, text=responses_text, include=junk | st.just(
                     ["message.output_text.logprobs"]), top_logprobs=small_tokens | junk,
                 reasoning=junk, truncation=junk, metadata=junk, store=junk, background=junk,
                 previous_response_id=junk)
SCORE = body(token_ids=st.lists(st.integers(-5, 600), max_size=12) | junk,
             start=st.integers(-2, 12) | junk, prompt_token_ids=junk, output_token_ids=junk)


ROUTES = {"/v1/messages": ANTHROPIC, "/v1/chat/completions": CHAT,
          "/v1/completions": COMPLETION, "/v1/messages/count_tokens": COUNT, "/v1/score": SCORE,
          "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE, "/v1/responses": RESPONSES}
GET_PATHS = ["/health", "/metrics", "/v1/models", "/v1/state", "/openapi.json",
             "/v1/state/requests/msg_x", "/v1/state/requests/" + "z" * 300, "/", "/v1",
             "/v1/messages/x", "/v1/../v1/state", "/v1/state%00", "/metrics/",
             "/v1/responses/resp_x", "/v1/responses/resp_x/input_items",
             "/v1/responses/" + "r" * 300]
VALID = {"/v1/messages": anthropic_body(max_tokens=4),
         "/v1/chat/completions": {**anthropic_body(max_tokens=4), "stream": False},
         "/v1/completions": {"model": "dummy:tiny", "prompt": "hi", "max_tokens": 4},
         "/v1/messages/count_tokens": {"model": "dummy:tiny",
                                       "messages": [{"role": "user", "content": "hi"}]},
         "/v1/score": {"token_ids": [5, 6, 7]},
         "/tokenize": {"messages": [{"role": "user", "content": "hi"}]},
         "/detokenize": {"tokens": [5, 6, 7]},
         "/v1/responses": {"model": "dummy:tiny", "input": "hi", "max_output_tokens": 4}}
"""A valid body per route: near-valid requests override a few of its fields with fuzz."""
SURROGATES = st.sampled_from(["\\ud800", "\\udfff", "a\\ud83d", "\\ud83d\\ude00\\udc00"])
CONTENT_TYPES = st.sampled_from(["application/json"] * 16 + [
    "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=b", "application/vnd.api+json", "", "json", "*/*"])
HOSTS = st.sampled_from([None] * 16 + ["localhost", "127.0.0.1:1", "[::1]", "evil.example",
                                      "evil.example:80", "", "a" * 300, "localhost.evil"])
ORIGINS = st.sampled_from([None] * 10 + ["https://app.example", "https://evil.example", "null"])


def _json_body(route_and_fields, near_valid: bool = False) -> bytes:
    path, fields = route_and_fields
    if near_valid:
        # max_tokens stays small: an absent one means "fill the context", thousands of tokens.
        overrides = {k: v for k, v in fields.items()
                     if k not in ("max_tokens", "max_output_tokens")}
        fields = {**VALID[path], **dict(list(overrides.items())[:2])}
    try:
        return json.dumps(fields).encode()
    except (ValueError, OverflowError):
        return b"{}"


def _surrogate_body(path_and_text) -> bytes:
    path, text = path_and_text
    if path == "/v1/completions":
        return f'{{"model":"dummy:tiny","max_tokens":2,"prompt":"{text}"}}'.encode()
    if path == "/v1/responses":
        return (f'{{"model":"dummy:tiny","max_output_tokens":2,"instructions":"{text}",'
                f'"input":[{{"role":"user","content":"{text}"}}]}}').encode()
    return ('{"model":"dummy:tiny","max_tokens":2,"system":"x","messages":[{"role":"user",'
            f'"content":"{text}"}}]}}').encode()


def _history_request(parts) -> dict:
    """A near-valid body around a tool history, for a route that reads chat messages."""
    path, openai_turns, anthropic_turns, stream, tools, add_generation_prompt = parts
    anthropic = path.startswith("/v1/messages")
    fields = {"model": "dummy:tiny", "messages": anthropic_turns if anthropic else openai_turns}
    if tools:
        fields["tools"] = [{"name": "f", "input_schema": {"type": "object"}}] if anthropic \
            else [{"type": "function", "function": {"name": "f"}}]
    if path == "/tokenize":
        fields["add_generation_prompt"] = add_generation_prompt
    elif path != "/v1/messages/count_tokens":
        fields.update(max_tokens=4, stream=stream)
    return {"method": "POST", "path": path, "content": json.dumps(fields).encode()}


tool_history_post = st.tuples(
    st.sampled_from(["/v1/chat/completions", "/tokenize", "/v1/messages",
                     "/v1/messages/count_tokens"]), openai_history, anthropic_history,
    st.booleans(), st.booleans(), st.booleans()).map(_history_request)
json_post = st.one_of(*[st.tuples(st.just(p), strategy) for p, strategy in ROUTES.items()]).map(
    lambda pair: {"method": "POST", "path": pair[0], "content": _json_body(pair)})
near_valid_post = st.one_of(*[st.tuples(st.just(p), strategy)
                               for p, strategy in ROUTES.items()]).map(
    lambda pair: {"method": "POST", "path": pair[0], "content": _json_body(pair, True)})
surrogate_post = st.tuples(st.sampled_from(list(ROUTES)), SURROGATES).map(
    lambda pair: {"method": "POST", "path": pair[0], "content": _surrogate_body(pair)})
raw_post = st.tuples(st.sampled_from(list(ROUTES)), st.binary(max_size=120)).map(
    lambda pair: {"method": "POST", "path": pair[0], "content": pair[1]})
get = st.tuples(st.sampled_from(GET_PATHS), st.text(max_size=12)).map(
    lambda pair: {"method": "GET", "path": pair[0], "params": {"q": pair[1]} if pair[1] else None})
odd_method = st.tuples(st.sampled_from(["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "GET",
                                        "POST"]), st.sampled_from(list(ROUTES) + GET_PATHS)).map(
    lambda pair: {"method": pair[0], "path": pair[1], "content": b""})
REQUESTS = st.tuples(
    st.one_of(json_post, json_post, near_valid_post, near_valid_post, tool_history_post,
              surrogate_post, raw_post, get, odd_method),
    CONTENT_TYPES, HOSTS, ORIGINS).map(
    lambda t: {**t[0], "headers": {k: v for k, v in (("content-type", t[1]), ("host", t[2]),
                                                     ("origin", t[3])) if v is not None}})
"""A whole request: {method, path, headers, content?, params?}."""


def send(client: httpx.Client, request: dict) -> httpx.Response:
    """Send one fuzzed request, read it to its end, and check what came back: never a 5xx
    (/health's 503 only while not ready), streams ending explicitly, errors in an API shape."""
    headers = dict(request["headers"])
    if request["method"] == "OPTIONS" and "origin" in headers:
        headers["access-control-request-method"] = "POST"
    with client.stream(request["method"], request["path"], content=request.get("content"),
                       params=request.get("params"), headers=headers) as response:
        response.read()
    assert response.status_code < 500, (request, response.text[:300])
    kind = response.headers.get("content-type", "")
    if response.status_code == 200 and kind.startswith("text/event-stream"):
        report = check_streams([type_stream(response.content)])
        assert report.streams[0].status in ("complete", "failed"), report.summary()
    elif response.status_code >= 400 and kind.startswith("application/json") \
            and request["method"] != "HEAD":
        error = response.json()
        assert "error" in error and error["error"]["message"], error
    return response


server = module_server("--profile", "ci")


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
    ("/v1/score", SCORE), ("/tokenize", TOKENIZE), ("/detokenize", DETOKENIZE),
    ("/v1/responses", RESPONSES),
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
@given(tool_history_post)
def test_tool_histories_never_5xx(client, request):
    post(client, request["path"], request["content"])


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_raw_bytes_never_5xx(client, raw):
    for path in ("/v1/messages", "/v1/chat/completions"):
        response = post(client, path, raw)
        assert response.status_code in (200, 400, 404), response.text


def gateway_resources(server) -> dict:
    """Open descriptors, threads and memory of the gateway process (leak check)."""
    import psutil

    process = psutil.Process(server.state()["gateway"]["pid"])
    return {"open_fds": process.num_fds(), "threads": process.num_threads(),
            "rss_bytes": process.memory_info().rss}


def test_whole_requests_on_every_route_never_5xx(server, client):
    server.wait_idle()
    before = gateway_resources(server)

    @settings(FUZZ, max_examples=300)
    @given(REQUESTS)
    def run(request):
        send(client, request)

    run()
    state = server.wait_idle()
    assert state["kv"]["free_blocks"] == state["kv"]["num_blocks"]
    after = gateway_resources(server)
    assert after["open_fds"] <= before["open_fds"] + 4, (before, after)
    assert after["threads"] <= before["threads"] + 4, (before, after)


def test_healthy_and_correct_after_fuzzing(server, client):
    assert client.get("/health").status_code == 200
    _, stream = record(client, "/v1/messages", anthropic_body(max_tokens=6, ignore_eos=True))
    report = check_streams([stream])
    assert report.ok and len(report.streams[0].token_ids) == 6
    server.wait_idle()
