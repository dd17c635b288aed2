"""Issue 31 item 4: what one request costs everyone else, bounded where bench/one_request_cost.py
found it was not. Counted, never timed: the work a request makes grows with its input, not with
its square."""

import threading
import time

import pytest

from tokstream.text.tokenizer import dummy_tokenizer

CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


class CountingText(str):
    """The rendered template's text, counting how often it is searched whole."""

    searches = 0

    def count(self, *args):
        CountingText.searches += 1
        return super().count(*args)

    def index(self, *args):
        CountingText.searches += 1
        return super().index(*args)

    def find(self, *args):
        CountingText.searches += 1
        return super().find(*args)


def test_special_token_text_in_many_messages_is_found_in_one_pass(monkeypatch):
    tokenizer = dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))
    tokenizer.chat_template = CHATML
    render = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template",
                        lambda *args, **kwargs: CountingText(render(*args, **kwargs)))
    messages = [{"role": "user", "content": f"m{n} <|eos|> <|bos|>"} for n in range(200)]
    CountingText.searches = 0
    ids = tokenizer.encode_chat(messages)
    # Each search reads the whole text (all 200 messages): one per message was quadratic.
    assert CountingText.searches <= 2, CountingText.searches
    # Still right: every message's special text stays text, the template's markers are control
    # tokens, in order.
    assert ids.count(0) == 201 and ids.count(1) == 200
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded.index("m0 <|eos|>") < decoded.index("m199 <|eos|>")
    plain = tokenizer.decode(ids, skip_special_tokens=True)
    assert plain.count("<|eos|> <|bos|>") == 200


class CountingCalls:
    """A tokenizers.Tokenizer that records its encode calls and the characters they read."""

    def __init__(self, backend):
        self._backend = backend
        self.calls: list[str] = []
        self.chars = 0

    def encode(self, text, *args, **kwargs):
        self.calls.append("encode")
        self.chars += len(text)
        return self._backend.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.calls.append("encode_batch")
        self.chars += sum(len(t) for t in texts)
        return self._backend.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_special_token_text_in_many_messages_is_tokenised_in_batches_that_free_the_gil():
    # count_tokens_special_6k: 6,000 messages holding special-token text were tokenised by
    # 12,001 encode calls (the template's text between messages, each message's own), and
    # encode holds the GIL: ~0.26 s of SmolLM2's tokenizer on the gateway's parse thread,
    # every write of the event loop waiting its turn. encode_batch lets go of it.
    tokenizer = dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))
    tokenizer.chat_template = CHATML
    messages = [{"role": "user", "content": f"m{n} <|eos|> <|bos|>"} for n in range(200)]
    expected = tokenizer.encode_chat(messages)
    backend = tokenizer.backend = CountingCalls(tokenizer.backend)
    plain = tokenizer._plain_backend = CountingCalls(tokenizer.prepare_user_text())
    assert tokenizer.encode_chat(messages) == expected
    # 201 texts of the template's, 200 of the messages': a batch or two each.
    calls = backend.calls + plain.calls
    assert set(calls) == {"encode_batch"} and len(calls) <= 4, (len(backend.calls),
                                                                len(plain.calls))


def test_a_long_text_is_tokenised_while_other_threads_run():
    # The gateway tokenises a large body on a worker thread so its event loop keeps writing
    # streams; that only helps if tokenising lets go of the GIL (Tokenizer.encode does not).
    tokenizer = dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))
    text = "hello world, it is a long prompt " * 40000  # ~1.3 MB
    started, done = threading.Event(), threading.Event()
    ids: list[int] = []

    def encode():
        started.set()
        ids.extend(tokenizer.encode_text(text))
        done.set()

    thread = threading.Thread(target=encode)
    thread.start()
    started.wait(10)
    turns = 0
    while not done.is_set() and turns < 100000:
        turns += 1
        time.sleep(0.0005)
    thread.join(60)
    # Counted, not timed: how often this thread ran while the other was tokenising.
    assert turns >= 100, turns
    assert ids == tokenizer._plain_backend.encode(text, add_special_tokens=False).ids


class CountingBackend:
    """A tokenizers.Tokenizer that counts reads of its added-tokens table."""

    def __init__(self, backend):
        self._backend = backend
        self.table_reads = 0

    def get_added_tokens_decoder(self):
        self.table_reads += 1
        return self._backend.get_added_tokens_decoder()

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_top_logprobs_work_out_each_tokens_bytes_once():
    from tokstream.engine.messages.worker import TokenLogprobs
    from tokstream.server.api.content_logprobs import ContentLogprobs

    tokenizer = dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))
    counting = tokenizer.backend = CountingBackend(tokenizer.backend)
    entries = ContentLogprobs(tokenizer)
    tokens = [100 + n % 30 for n in range(200)]
    top = TokenLogprobs(-0.5, list(range(100, 120)), [-0.5 - n for n in range(20)])
    text = tokenizer.decode(tokens)
    listed = entries.feed(tokens, [top] * len(tokens), text) + entries.finish()
    assert len(listed) == 200 and all(len(e["top_logprobs"]) == 20 for e in listed)
    # 200 tokens x 21 pieces over 30 distinct ids: the table is read per id, not per piece.
    assert counting.table_reads <= 2 + 30, counting.table_reads


class FakeCore:
    """The engine handle's surface the gateway's Server touches (no core behind it)."""

    def __init__(self):
        from tokstream.config import EngineConfig

        self.config = EngineConfig()
        self.info = {"max_model_len": 100000, "num_blocks": 64, "block_size": 16}
        self.dead = None
        self.pool = None
        self.restarts = self.resumed_requests = 0
        self.recovery_seconds: list[float] = []

    async def state(self) -> dict:
        return {"running": 0, "waiting": 0}


def test_count_tokens_with_special_token_text_builds_no_tokenizer_while_serving(monkeypatch):
    # Building encode_text's tokenizer copy holds the GIL (~0.3 s for SmolLM2's): the first
    # count_tokens over messages holding special-token text built it on its parse thread
    # and /health/live waited 258-634 ms. The gateway builds it before it serves.
    import asyncio

    import httpx
    from starlette.applications import Starlette

    from tokstream.text import tokenizer as tokenizer_module
    from tokstream.gateway_config import ServerConfig
    from tokstream.server.app import routes
    from tokstream.server.server import Server

    builds = []
    real = tokenizer_module.BackendTokenizer

    class CountingBackendTokenizer:
        @staticmethod
        def from_str(text):
            builds.append(len(text))
            return real.from_str(text)

    tokenizer = dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))
    tokenizer.chat_template = CHATML
    monkeypatch.setattr(tokenizer_module, "BackendTokenizer", CountingBackendTokenizer)
    messages = [{"role": "user", "content": f"m{n} <|eos|> <|bos|>"} for n in range(50)]

    async def scenario():
        server = Server(ServerConfig(), FakeCore(), tokenizer, model_id="m", aliases=set())
        app = Starlette(routes=routes())
        app.state.server = server
        built_before_serving = len(builds)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            reply = await client.post("/v1/messages/count_tokens",
                                      json={"model": "m", "messages": messages})
        return built_before_serving, reply

    built_before_serving, reply = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert reply.status_code == 200, reply.text
    assert reply.json()["input_tokens"] == len(tokenizer.encode_chat(messages))
    built_while_serving = len(builds) - built_before_serving
    assert built_while_serving == 0, f"{built_while_serving} tokenizer copy built while serving"


RESULTS = 200
TOOL_CHAT = [{"role": "user", "content": "Look these up."},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": f"call_{i}", "type": "function",
                  "function": {"name": "lookup", "arguments": "{}"}} for i in range(RESULTS)]},
             *({"role": "tool", "tool_call_id": f"call_{i}", "content": "x" * 1000}
               for i in range(RESULTS))]
PAST_CONTEXT = {
    "/v1/chat/completions": {"model": "m", "max_tokens": 8, "messages": TOOL_CHAT, "tools": [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
    "/v1/messages": {"model": "m", "max_tokens": 8,
                     "messages": [{"role": "user", "content": "x" * 200000}]},
    "/v1/completions": {"model": "m", "max_tokens": 8, "prompt": "x" * 200000},
}


@pytest.mark.parametrize("path", list(PAST_CONTEXT))
def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenised(path):
    # bench/one_request_cost.py's tool_results_2k: 2,000 tool results of 1,000 characters
    # each, tokenised whole (1.2 s of a core on SmolLM2's tokenizer, a core the rank's streams
    # lost) to end in the 400 for a prompt past the context. 200,000 characters of text are
    # at least 200,000 / the longest token's bytes tokens, past 4,096.
    import asyncio

    import httpx
    from starlette.applications import Starlette

    from tokstream.gateway_config import ServerConfig
    from tokstream.server.app import routes
    from tokstream.server.server import Server

    tokenizer = dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))
    tokenizer.chat_template = CHATML
    counting = tokenizer.backend = CountingCalls(tokenizer.backend)
    core = FakeCore()
    core.info = {**core.info, "max_model_len": 4096}

    async def scenario():
        app = Starlette(routes=routes())
        app.state.server = Server(ServerConfig(), core, tokenizer, model_id="m", aliases=set())
        counting.chars = 0  # the server's start tokenises a few words to start its pool
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=PAST_CONTEXT[path])

    reply = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert reply.status_code == 400, reply.text
    assert "at least" in reply.text and "4096 tokens" in reply.text, reply.text
    assert counting.chars == 0, f"{counting.chars} characters tokenised for a refusal"


BOUND_TEXTS = [("\n" + " " * 80) * 100, "#" * 800, "word " * 500, "日本語のテキスト" * 100,
               "🙂" * 300, "<|im_start|>" * 50, "x" * 5000, "a1b2c3 " * 300]


@pytest.mark.parametrize("text", BOUND_TEXTS, ids=range(len(BOUND_TEXTS)))
def test_the_length_bound_never_passes_the_token_count(text):
    # refuse_past refuses by a lower bound on the tokens: it must never exceed the real count,
    # or a prompt that fits would be refused. SmolLM2's longest piece is a newline and 80
    # spaces (the first text is 100 of them: the bound is exact there), then runs of "#";
    # special-token text is one token of 12 characters.
    from tokstream.model.source import resolve_model
    from tokstream.text.token_bound import fewest_tokens
    from tokstream.text.tokenizer import load_tokenizer

    for tokenizer in (load_tokenizer(resolve_model("smollm2")),
                      dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))):
        fewest = fewest_tokens(len(text), tokenizer.max_token_bytes)
        assert 0 < fewest <= len(tokenizer.encode(text)), (fewest, len(tokenizer.encode(text)))
        assert fewest <= len(tokenizer.encode_text(text))


SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
TOOLS = [{"name": "lookup", "input_schema": SCHEMA}]
GRAMMAR_BODIES = {
    "/v1/chat/completions": {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}], "output_config": {
            "format": {"type": "json_schema", "schema": SCHEMA}}},
    "/v1/messages/count_tokens": {"model": "m", "tools": TOOLS, "messages": [
        {"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("path", list(GRAMMAR_BODIES))
def test_a_small_body_compiles_its_grammar_off_the_event_loop(path, monkeypatch):
    # json_deep_50: a 5 KB body is parsed inline (only large bodies went to a thread), and its
    # schema, nested 50 deep, took llguidance 8-9 ms to validate there: the event loop, and
    # every stream it writes, waited. count_tokens compiled its tools' schemas inline too.
    import asyncio

    import httpx
    from starlette.applications import Starlette

    from tokstream.errors import UserInputError
    from tokstream.gateway_config import ServerConfig
    from tokstream.server.app import routes
    from tokstream.server.server import Server
    from tokstream.structured import StructuredOutput

    compiled_on_loop = []

    def grammar(self):
        try:
            asyncio.get_running_loop()
            compiled_on_loop.append(True)
        except RuntimeError:
            compiled_on_loop.append(False)
        raise UserInputError("refused here: the test asks only where it was compiled")

    monkeypatch.setattr(StructuredOutput, "grammar", grammar)
    tokenizer = dummy_tokenizer(400, bos_token_id=0, eos_token_ids=(1,))
    tokenizer.chat_template = CHATML

    async def scenario():
        app = Starlette(routes=routes())
        app.state.server = Server(ServerConfig(), FakeCore(), tokenizer, model_id="m",
                                  aliases=set())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=GRAMMAR_BODIES[path])

    reply = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert reply.status_code == 400 and "refused here" in reply.text, reply.text
    assert compiled_on_loop == [False], compiled_on_loop
