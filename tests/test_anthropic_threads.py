"""The Messages API's threads (beta message-threads-2026-08-12), which the anthropic SDK's
tool runner and `messages.thread()` use by default: against a real `tokstream serve` on
dummy:tiny, a tool runner's turns after the first send only their new messages, run and
streamed, and the model is shown the whole conversation (its prompt counts as the same
history sent whole); a thread's send/stream turns; the errors a client recovers from; and,
without a server, what a thread keeps and whose it is."""

from typing import Annotated

import anthropic
import httpx
import httpx2
import pytest
from pydantic import Field

from helpers.serving import module_server
from tokstream.server.api.anthropic_threads import conversation_size, keep_reply, with_thread
from tokstream.server.api.conversation_store import ConversationStore, json_size
from tokstream.server.api_errors import ApiError

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

MODEL = "dummy:tiny"
SEEDED = {"temperature": 1.0, "seed": 7}

server = module_server("--profile", "ci")


class Recorder:
    """The JSON body of every request a client sends."""

    def __init__(self):
        self.bodies: list[dict] = []

    def __call__(self, request) -> None:
        import json
        self.bodies.append(json.loads(request.read() or b"{}"))


@pytest.fixture
def sent():
    return Recorder()


@pytest.fixture
def claude(server, sent):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             http_client=httpx2.Client(event_hooks={"request": [sent]})) as c:
        yield c


def counted(server, body: dict) -> int:
    """The prompt tokens of a whole, unthreaded body (count_tokens)."""
    fields = {k: v for k, v in body.items() if k in ("model", "system", "tools", "messages")}
    return httpx.post(server.url + "/v1/messages/count_tokens", json=fields,
                      timeout=30).json()["input_tokens"]


def prompt_tokens(usage) -> int:
    return (usage.input_tokens + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0))


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_runner_runs_over_a_thread(server, claude, sent, stream):
    from anthropic import beta_tool

    cities = []

    @beta_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """Get the weather in a city.

        Args:
            city: The city.
        """
        cities.append(city)
        return "sunny, 21C"

    # tool_choice any: a call every turn (dummy:tiny never calls one of its own accord).
    runner = claude.beta.messages.tool_runner(
        model=MODEL, max_tokens=150, tools=[get_weather], tool_choice={"type": "any"},
        system="Use the tools.", max_iterations=2, stream=stream, extra_body=SEEDED,
        messages=[{"role": "user", "content": "weather in Paris?"}])
    replies = [item.get_final_message() if stream else item for item in runner]
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use"] and len(cities) == 2
    first, second = sent.bodies
    assert first["thread"] == {"type": "create"} and first["system"] == "Use the tools."
    assert second["thread"] == {"type": "continue", "previous_message_id": replies[0].id}
    assert "tools" not in second and "system" not in second
    assert [m["content"][0]["type"] for m in second["messages"]] == ["tool_result"]
    # The second turn's prompt is the whole conversation: system, tools, the question, the
    # first call and its result.
    whole = {**first, "messages": first["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in replies[0].content]},
        *second["messages"]]}
    assert prompt_tokens(replies[1].usage) == counted(server, whole)


def test_a_threads_turns_send_only_their_messages(server, claude, sent):
    thread = claude.beta.messages.thread(model=MODEL, max_tokens=8, system="Be brief.",
                                         extra_body=SEEDED)
    first = thread.send({"role": "user", "content": "My name is Ann."})
    with thread.stream({"role": "user", "content": "What is my name?"}) as streamed:
        second = streamed.get_final_message()
    assert sent.bodies[1]["thread"]["previous_message_id"] == first.id
    assert [m["content"] for m in sent.bodies[1]["messages"]] == ["What is my name?"]
    history = [{"role": "user", "content": "My name is Ann."},
               {"role": "assistant", "content": first.content[0].text},
               {"role": "user", "content": "What is my name?"}]
    assert prompt_tokens(second.usage) == counted(
        server, {"model": MODEL, "system": "Be brief.", "messages": history})


def test_what_a_client_recovers_from(server):
    def post(**fields):
        return httpx.post(server.url + "/v1/messages", timeout=30, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            **fields})

    lost = post(thread={"type": "continue", "previous_message_id": "msg_gone"})
    assert lost.status_code == 404
    assert lost.json()["error"]["details"] == {"error_code": "thread_not_found"}
    made = post(thread={"type": "create"}).json()
    repeated = post(system="again", thread={"type": "continue",
                                            "previous_message_id": made["id"]})
    assert repeated.status_code == 400 and "system" in repeated.json()["error"]["message"]
    assert post(thread={"type": "fork"}).status_code == 400
    assert post(thread={"type": "continue"}).status_code == 400
    twice = [post(thread={"type": "continue", "previous_message_id": made["id"]})
             for _ in range(2)]
    assert [r.status_code for r in twice] == [200, 200]  # a reply may be continued again


def test_a_thread_is_kept_for_its_owner_and_refused_when_nothing_is_kept():
    store = ConversationStore(max_bytes=2**20)
    created = {"model": MODEL, "system": "s", "tools": [{"name": "f"}],
               "thread": {"type": "create"}, "messages": [{"role": "user", "content": "a"}]}
    seen = with_thread(created, store, "alice")
    keep_reply(store, "alice", seen, conversation_size(seen), "msg_1",
               [{"type": "text", "text": "b"}])
    # Measured in two parts (the conversation where it is parsed, the reply at the end): the
    # record's JSON less its keys and punctuation.
    assert 0 < json_size(store.get("alice", "msg_1")) - store.bytes < 64
    follow = {"model": MODEL, "thread": {"type": "continue", "previous_message_id": "msg_1"},
              "messages": [{"role": "user", "content": "c"}]}
    seen = with_thread(follow, store, "alice")
    assert seen["system"] == "s" and seen["tools"] == [{"name": "f"}]
    assert [m["content"] for m in seen["messages"]] == ["a", [{"type": "text", "text": "b"}],
                                                         "c"]
    with pytest.raises(ApiError) as other:
        with_thread(follow, store, "bob")
    assert other.value.details == {"error_code": "thread_not_found"}
    keep_reply(store, "alice", {**follow, "thread": None}, 0, "msg_2", [])  # unthreaded
    assert store.get("alice", "msg_2") is None
    with pytest.raises(ApiError) as off:
        with_thread(created, ConversationStore(max_bytes=0), "alice")
    assert off.value.details["error_code"] == "thread_unsupported_request"
