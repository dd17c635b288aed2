"""`n` choices on the OpenAI routes: the engine prefills a prompt shared by a group of requests
once and lets the prefix cache serve it to the others (pure Python, below); through a real
server with the official SDK, n choices streamed and not, each equal to a lone request with
its derived seed, usage summed, a typed 400 outside 1-16, and the integrity checker reading
each choice of a multi-choice stream as its own stream."""

import asyncio
import itertools
import json
import os
import signal

import httpx
import openai
import pytest

from helpers.serving import ServerProcess, record
from tokstream.checker import (OPT_IN, RecordedStream, SSEEvent, SSERecorder, check_streams,
                               choice_request_id)
from tokstream.config import SchedulerConfig
from tokstream.engine.block_manager import BlockManager
from tokstream.engine.messages.request import token_digest
from tokstream.engine.request import Request
from tokstream.engine.scheduler.scheduler import Scheduler
from tokstream.sampling_params import SamplingParams

pytestmark = pytest.mark.startup  # starts servers or engines (make test-fast leaves it out)

_clock = itertools.count()
PROMPT = list(range(100, 140))
"""40 tokens: 10 full blocks of 4 (9 of them shareable: one token is always computed)."""


def group_request(rid, group="cmpl-1", prompt=PROMPT, outputs=()):
    return Request(rid, list(prompt), SamplingParams(max_tokens=16, temperature=0), seed=0,
                   arrival=float(next(_clock)), output_token_ids=list(outputs),
                   prompt_group=group)


def scheduler(budget=256, caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     watermark_blocks=0),
                     BlockManager(64, 4, enable_caching=caching), max_model_len=1000)


def step(s):
    out = s.schedule()
    s.update(out, [7] * sum(w.samples for w in out.work))
    assert s.check() == []
    return out


def prefilled(out):
    return {w.request.request_id: w.num_tokens for w in out.work if w.num_tokens > 1}


def test_a_group_prefills_its_prompt_once_and_shares_its_blocks():
    s = scheduler()
    choices = [group_request(f"cmpl-1-{i}") for i in range(3)]
    for request in choices:
        s.add_request(request)
    # The first choice prefills the prompt alone; the others wait for its blocks to be cached,
    # then compute only the tail the cache cannot hold (the last block's tokens).
    assert prefilled(step(s)) == {"cmpl-1-0": 40}
    assert prefilled(step(s)) == {"cmpl-1-1": 4, "cmpl-1-2": 4}
    shared = choices[0].block_ids[:9]
    assert all(r.block_ids[:9] == shared for r in choices)
    assert all(s.block_manager.ref_counts[b] == 3 for b in shared)
    assert len({r.block_ids[9] for r in choices}) == 3  # each writes its own last block


def test_a_resumed_group_shares_its_prompt_again():
    """Members holding output already (resumed requests), and again after a rank-group restart
    (every one re-prefills prompt + its own output): one of them first, then the others from
    its cached prompt blocks. A request outside the group is not held, except behind a held
    member that was preempted (those come back in order)."""
    s = scheduler()
    choices = [group_request(f"cmpl-1-{i}", outputs=[50 + i] * 6) for i in range(3)]
    other = group_request("other", group="", prompt=list(range(300, 340)))
    for request in [*choices, other]:
        s.add_request(request)
    assert prefilled(step(s)) == {"cmpl-1-0": 46, "other": 40}
    # The prompt is exactly 10 blocks: the others compute their own output tokens only.
    assert prefilled(step(s)) == {"cmpl-1-1": 6, "cmpl-1-2": 6}
    s.requeue_all()  # the pool's contents are gone
    assert prefilled(step(s)) == {"cmpl-1-0": 48}
    assert prefilled(step(s)) == {"cmpl-1-1": 7, "cmpl-1-2": 7, "other": 42}


def test_no_hold_without_a_prefix_cache_or_a_full_block():
    s = scheduler(caching=False)
    for i in range(3):
        s.add_request(group_request(f"cmpl-1-{i}"))
    assert len(prefilled(step(s))) == 3
    s = scheduler()
    for i in range(3):
        s.add_request(group_request(f"cmpl-2-{i}", group="cmpl-2", prompt=[1, 2, 3]))
    assert len(step(s).work) == 3


# --- the checker on hand-built multi-choice streams -------------------------------------------

CHOICE_TOKENS = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]


def chunk(index, ext, text=""):
    return SSEEvent(None, json.dumps({"id": "cmpl-x", "object": "text_completion", "choices": [
        {"index": index, "text": text}], "tokstream": ext}), str(ext["indices"][-1]))


def choice_stream(drop=None, stamp=None, fail_after_first=False, num_choices=3):
    """Three choices' token chunks interleaved, then their final chunks and [DONE]; `drop`:
    (choice, position) left out; `stamp`: (choice, position, engine id) put on a token."""
    events = []
    for position in range(3):
        for index, tokens in enumerate(CHOICE_TOKENS):
            if (index, position) == drop:
                continue
            rid = choice_request_id("cmpl-x", index)
            if stamp and stamp[:2] == (index, position):
                rid = stamp[2]
            events.append(chunk(index, {"request_id": rid, "token_ids": [tokens[position]],
                                        "indices": [position]}, f"t{tokens[position]}"))
    for index, tokens in enumerate(CHOICE_TOKENS):
        events.append(SSEEvent(None, json.dumps({"id": "cmpl-x", "choices": [
            {"index": index, "text": "", "finish_reason": "length"}], "tokstream": {
                "request_id": choice_request_id("cmpl-x", index), "num_output_tokens": 3, "digest": token_digest(tokens),
                "finish_reason": "length"}})))
        if fail_after_first:
            events.append(SSEEvent(None, json.dumps({"error": {"message": "boom",
                                                               "type": "api_error"}})))
            break
    events.append(SSEEvent(None, json.dumps({"id": "cmpl-x", "choices": [], "usage": {}})))
    return RecordedStream(events + [SSEEvent(None, "[DONE]")], num_choices=num_choices)


def test_the_checker_reads_each_choice_as_its_own_stream():
    report = check_streams([choice_stream()])
    assert report.ok, report.summary()
    assert [s.request_id for s in report.streams] == ["cmpl-x", "cmpl-x-1", "cmpl-x-2"]
    assert [s.token_ids for s in report.streams] == CHOICE_TOKENS
    assert report.streams[1].text == "t21t22t23"


def test_the_checker_names_damage_to_one_choice():
    lost = check_streams([choice_stream(drop=(2, 1))])
    assert lost.count("lost") == 1 and lost.streams[2].problems and lost.streams[0].ok
    # A token of choice 2 delivered as choice 1's: foreign to choice 1, lost to neither.
    strayed = check_streams([choice_stream(stamp=(1, 0, "cmpl-x-2"))])
    assert strayed.count("foreign") == 1 and not strayed.streams[1].ok
    failed = check_streams([choice_stream(fail_after_first=True)])
    assert [s.status for s in failed.streams] == ["complete", "failed", "failed"]
    assert failed.count("ended_twice") == 0
    missing = check_streams([choice_stream(num_choices=4)])  # asked for 4, got 3
    assert [s.status for s in missing.streams] == ["complete"] * 3 + ["cut"]


# --- the gateway's collection of choices, on hand-fed channels ------------------------------

def test_collecting_stops_at_a_failed_choice_and_aborts_the_others():
    from tokstream.engine.messages.request import RequestDelta
    from tokstream.server.api.choices import collect_choices
    from tokstream.server.streaming.sse import stream_failure
    from tokstream.server.streaming.streams import Channel, Stream

    class Registry:
        def __init__(self):
            self.closed = []

        def close(self, stream, reason=None):
            self.closed.append(stream.request_id)

    async def main():
        streams = [Stream(choice_request_id("cmpl-y", i), [1, 2], SamplingParams(), None,
                          "openai", Channel(None)) for i in range(3)]
        failed = RequestDelta(streams[1].request_id, [], 0, "", finish_reason="error",
                              error="the replica is down")
        streams[1].final = failed
        streams[1].channel.put(failed)
        streams[0].channel.put(RequestDelta(streams[0].request_id, [5], 0, "x"))
        registry = Registry()
        batches = await collect_choices(streams, asyncio.Event().wait, registry)
        return streams, batches, registry

    streams, batches, registry = asyncio.run(main())
    assert stream_failure(streams[1])[0] == "overloaded_error" and len(batches) == 3
    assert registry.closed == [s.request_id for s in streams]  # the others are aborted


# --- through a real server ----------------------------------------------------------------

MODEL = "dummy:tiny"
MAIN, METERED, ADMIN = "sk-main-n-choices", "sk-metered-n-choices", "sk-admin-n-choices"


def prompt_ids(tag: int, length: int = 30) -> list[int]:
    """A prompt no other test sends (so its prefix-cache hits are this test's own)."""
    return [(7 + tag * 31 + i * 13) % 500 for i in range(length)]


def auth(key=MAIN) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tokstream.server.access.tenants import hash_key

    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(f"""
admin_key_sha256 = "{hash_key(ADMIN)}"

[[tenant]]
name = "main"
key_sha256 = "{hash_key(MAIN)}"

[[tenant]]
name = "metered"
key_sha256 = "{hash_key(METERED)}"
tokens_per_minute = 1000
""")
    with ServerProcess("--profile", "ci", "--tenants", str(tenants)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=MAIN, max_retries=0)


def complete(server, key=MAIN, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body},
                      headers=auth(key), timeout=120)


def test_completions_choices_share_the_prompt_and_equal_lone_requests(server):
    prompt = prompt_ids(1)
    body = dict(prompt=prompt, max_tokens=6, temperature=1.0, ignore_eos=True)
    reply = complete(server, n=3, seed=41, **body).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert reply["usage"] == {"prompt_tokens": 30, "completion_tokens": 18, "total_tokens": 48,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    ext = reply["tokstream"]["choices"]
    # Choice 0 computed the prompt; the others took its 7 full blocks (of 4 tokens) from it.
    assert [c["cached_tokens"] for c in ext] == [0, 28, 28]
    assert len({tuple(c["token_ids"]) for c in ext}) == 3  # seeds 41, 42, 43 differ
    lone = [complete(server, seed=41 + i, **body).json() for i in range(3)]
    assert [c["token_ids"] for c in ext] == [r["tokstream"]["token_ids"] for r in lone]
    assert [c["text"] for c in reply["choices"]] == [r["choices"][0]["text"] for r in lone]


def test_chat_choices_through_the_sdk_streamed_and_not(client, server):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "three ways to say hi"}],
                  n=3, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 18
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) == 3
    streamed, roles, finished, usage, ids = ["", "", ""], set(), set(), None, set()
    for chunk in client.chat.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}):
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        streamed[choice.index] += choice.delta.content or ""
        roles |= {choice.index} if choice.delta.role == "assistant" else set()
        finished |= {choice.index} if choice.finish_reason == "length" else set()
    assert streamed == texts and roles == finished == {0, 1, 2} and len(ids) == 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (reply.usage.prompt_tokens, 18)
    # Recorded with the integrity framing: each choice is a stream of its own, intact.
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _, recorded = record(http, "/v1/chat/completions", {
            "model": MODEL, "messages": kwargs["messages"], "n": 3, "max_tokens": 6,
            "temperature": 1.0, "seed": 7, "ignore_eos": True, "stream": True}, auth())
    recorded.num_choices = 3
    report = check_streams([recorded])
    assert report.ok and report.statuses["complete"] == 3, report.summary()
    assert len({tuple(s.token_ids) for s in report.streams}) == 3


@pytest.mark.parametrize("n", [0, 17, "2", 1.5, -1])
def test_n_outside_1_to_16_is_a_typed_400(server, n):
    response = complete(server, prompt="hi", max_tokens=2, n=n)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "n", error


def test_a_caller_leaving_cancels_every_choice(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", headers={**auth(), **OPT_IN}, json={
                "model": MODEL, "prompt": prompt_ids(3), "n": 3, "max_tokens": 2000,
                "ignore_eos": True, "stream": True}) as response:
            request_id = response.headers["x-request-id"]
            recorder, seen = SSERecorder(), set()
            for chunk in response.iter_bytes():
                for event in recorder.feed(chunk):
                    seen |= {json.loads(event.data)["choices"][0]["index"]}
                if seen == {0, 1, 2}:
                    break
    state = server.wait_idle(**auth(ADMIN))
    cancelled = {e["request_id"] for e in state["events"] if e["kind"] == "cancelled"}
    assert {choice_request_id(request_id, i) for i in range(3)} <= cancelled


def test_the_tenant_is_charged_for_every_choice(server):
    """1,000 tokens a minute: while 16 choices of 50 tokens (and a 10-token prompt) run, what
    they reserved leaves too little for another 300. The prompt is counted once, the request
    once among those live, and every choice's output."""
    prompt = prompt_ids(4, length=10)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", headers=auth(METERED), json={
                "model": MODEL, "prompt": prompt, "n": 16, "max_tokens": 50,
                "ignore_eos": True, "temperature": 0, "stream": True}) as running:
            assert running.status_code == 200  # admitted: its reservation is taken
            refused = complete(server, METERED, prompt=prompt, max_tokens=300)
            assert refused.status_code == 429, refused.text
            running.read()
    (row,) = [t for t in server.wait_idle(**auth(ADMIN))["tenants"] if t["name"] == "metered"]
    assert (row["live"], row["prompt_tokens"], row["output_tokens"]) == (0, 10, 800)


def test_penalised_choices_resume_after_the_engine_core_is_killed(server):
    """Both choices of a penalised, biased, seeded request are resubmitted to a new core with
    the tokens they had delivered, and end exactly as an uninterrupted run."""
    body = {"model": MODEL, "prompt": prompt_ids(5), "n": 2, "max_tokens": 64,
            "temperature": 0.9, "seed": 11, "ignore_eos": True, "frequency_penalty": 1.0,
            "presence_penalty": 0.6, "repetition_penalty": 1.3, "logit_bias": {"5": 6.0}}
    reference = complete(server, **body).json()["tokstream"]["choices"]
    before = server.state(**auth(ADMIN))
    recorder, received = SSERecorder(), [0, 0]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True},
                         headers={**auth(), **OPT_IN}) as response:
            for chunk in response.iter_bytes():
                for event in recorder.feed(chunk):
                    data = json.loads(event.data) if event.data.startswith("{") else {}
                    if data.get("choices") and "token_ids" in data.get("tokstream", {}):
                        received[data["choices"][0]["index"]] += len(data["tokstream"]
                                                                     ["token_ids"])
                if min(received) >= 4 and before["engine"]["pid"]:
                    os.kill(before["engine"]["pid"], signal.SIGKILL)
                    before["engine"]["pid"] = None
    recorded = recorder.stream()
    recorded.num_choices = 2
    report = check_streams([recorded])
    assert report.ok and report.statuses["complete"] == 2, report.summary()
    assert [s.token_ids for s in report.streams] == [c["token_ids"] for c in reference]
    after = server.wait_idle(**auth(ADMIN))
    assert after["replica"]["restarts_by_kind"]["core"] == \
        before["replica"]["restarts_by_kind"]["core"] + 1
    assert after["replica"]["resumed_requests"]["core"] >= \
        before["replica"]["resumed_requests"]["core"] + 2
