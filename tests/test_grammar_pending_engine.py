"""Issue 31 item 4, through the engine core and a real worker process (dummy:tiny): while
constrained requests' grammars compile, the stream beside them decodes on, and they join once
their grammars are ready with the tokens a run that never held them gives: greedy and seeded,
n=2 choices of one prompt, with n-gram drafts, through a preemption and through a rank killed
meanwhile (the new rank compiles the grammars again). A grammar that does not compile within
grammar_compile_timeout_s ends its request alone with an invalid_request error; the stream
beside it completes unchanged.

The compiles are held by TOKSTREAM_GRAMMAR_GATE (a file the test creates when it has counted
enough of the other stream's tokens), so nothing here is timed."""

import os
import re
import signal

import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.errors import ErrorKind
from tokstream.sampling_params import SamplingParams
from tokstream.structured import StructuredOutput

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

GRAMMAR = 'start: WORD (" " WORD)*\nWORD: "abc" | "abd" | "xyz"'
G_TEXT = "abc abd abc abd xyz abc "
PLAIN_PROMPT = [5, 17, 99, 3] * 3
PLAIN = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
HELD_TOKENS = 8
"""Tokens the plain stream decodes while every grammar is held."""


def constrained(seed: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.0 if seed is None else 1.0, seed=seed,
                          structured=StructuredOutput("grammar", GRAMMAR))


def tiny(method: str = "off", num_blocks: int | None = None, **engine) -> EngineConfig:
    config = EngineConfig(model="dummy:tiny", dtype="float32",
                          cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=4))
    for key, value in engine.items():
        setattr(config, key, value)
    return config


def requests(llm: LLM, tag: str = "") -> list[EngineRequest]:
    """The plain stream first (the earliest arrival), then "g" (greedy) and n=2 seeded choices
    of one prompt, all constrained."""
    prompt = llm.encode(G_TEXT)
    return [EngineRequest(f"p{tag}", PLAIN_PROMPT, PLAIN),
            EngineRequest(f"g{tag}", prompt, constrained(None)),
            EngineRequest(f"c0{tag}", prompt, constrained(3), prompt_group=f"two{tag}"),
            EngineRequest(f"c1{tag}", prompt, constrained(4), prompt_group=f"two{tag}")]


@pytest.fixture
def gate(tmp_path, monkeypatch):
    """The gate file's path (absent: every grammar's compile waits on rank 0)."""
    path = tmp_path / "grammar-gate"
    monkeypatch.setenv("TOKSTREAM_GRAMMAR_GATE", str(path))
    monkeypatch.setenv("TOKSTREAM_SELF_CHECK", "1")
    yield path
    path.touch()


def run(llm: LLM, reqs: list[EngineRequest], between=None):
    """({request id: its tokens}, {request id: its last delta}); between(llm, tokens) runs
    after each delta."""
    tokens = {r.request_id: [] for r in reqs}
    finals = {}
    for delta in llm.stream(reqs):
        assert delta.first_index == len(tokens[delta.request_id])
        tokens[delta.request_id] += delta.token_ids
        if delta.finished:
            assert delta.request_id not in finals, "a stream ended twice"
            finals[delta.request_id] = delta
        if between is not None:
            between(llm, tokens)
    assert set(finals) == set(tokens)
    return tokens, finals


def open_gate_when(gate, ready):
    """A `between` that opens the gate once ready(llm, tokens), keeping each request's token
    count at that moment in .counts."""
    def between(llm, tokens):
        if not gate.exists() and ready(llm, tokens):
            between.counts = {rid: len(t) for rid, t in tokens.items()}
            gate.touch()
    between.counts = None
    return between


def assert_held_then_equal(llm, tokens, finals, counts, gate):
    """The grammars were held while the plain stream decoded HELD_TOKENS, and every stream's
    output is the one a run with the gate open gives."""
    assert counts is not None, "the gate never opened"
    assert counts["p"] >= HELD_TOKENS
    assert all(counts[rid] == 0 for rid in ("g", "c0", "c1")), counts
    assert gate.exists()
    reference, _ = run(llm, requests(llm, "-ref"))
    assert tokens == {rid.removesuffix("-ref"): t for rid, t in reference.items()}
    for rid in ("g", "c0", "c1"):
        assert finals[rid].finish_reason in ("stop", "length")
        text = llm.tokenizer.decode(tokens[rid])
        assert re.fullmatch(r"(abc|abd|xyz)( (abc|abd|xyz))*( (a|ab|x|xy)?)?", text), text
    assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks


@pytest.mark.parametrize("method", ["off", "ngram"])
def test_streams_decode_while_grammars_compile(gate, method):
    with LLM(tiny(method)) as llm:
        between = open_gate_when(gate, lambda llm, t: len(t["p"]) >= HELD_TOKENS)
        tokens, finals = run(llm, requests(llm), between)
        assert_held_then_equal(llm, tokens, finals, between.counts, gate)


def test_a_request_preempted_while_its_grammar_compiles(gate):
    # 16 blocks of 4: the plain stream's 52 tokens take 13, so the constrained requests that
    # arrived after it are preempted to make room while their grammars are still held.
    with LLM(tiny(num_blocks=16)) as llm:
        between = open_gate_when(gate, lambda llm, t: llm.core.scheduler.num_preemptions > 0)
        tokens, finals = run(llm, requests(llm), between)
        assert llm.core.scheduler.num_preemptions > 0
        assert_held_then_equal(llm, tokens, finals, between.counts, gate)


def test_a_rank_killed_while_grammars_compile(gate):
    with LLM(tiny()) as llm:
        killed = []

        def between(llm, tokens):
            if not killed and len(tokens["p"]) >= 3:
                killed.append(llm.core.executor.pids[0])
                os.kill(killed[0], signal.SIGKILL)
            opener(llm, tokens)
        opener = open_gate_when(gate, lambda llm, t: killed and len(t["p"]) >= HELD_TOKENS)
        tokens, finals = run(llm, requests(llm), between)
        assert llm.core.recovery.restarts == 1
        assert killed[0] not in llm.core.executor.pids
        assert_held_then_equal(llm, tokens, finals, opener.counts, gate)


def test_a_grammar_past_the_compile_limit_ends_its_request_alone(gate):
    with LLM(tiny(grammar_compile_timeout_s=0.5)) as llm:
        reqs = requests(llm)[:2]
        tokens, finals = run(llm, reqs)  # the gate stays shut
        failed = finals["g"]
        assert failed.finish_reason == "error" and failed.error_kind is ErrorKind.INVALID_REQUEST
        assert "within 0.5 s" in failed.error and "--grammar-compile-timeout" in failed.error
        assert tokens["g"] == [] and failed.num_output_tokens == 0
        assert finals["p"].finish_reason == "length"
        alone, _ = run(llm, [EngineRequest("p-alone", PLAIN_PROMPT, PLAIN)])
        assert tokens["p"] == alone["p-alone"]
        assert any(e["kind"] == "request_failed" and e["request_id"] == "g"
                   for e in llm.core.events)
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
