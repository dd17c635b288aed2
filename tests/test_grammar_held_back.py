"""Issue 31 item 4: no step waits for a grammar. On rank 0, a constrained request whose matcher
still compiles when a step would sample it is held back: the step samples the other streams,
leaves its row out and says so (StepResult.grammar_pending), and the core computes its last
position again in a later step, which samples it once the matcher is ready: the tokens a run
that waited for the compile gives. A compile that fails is reported for that request alone
(StepResult.grammar_failures) while the others are sampled. (The core's side, and the limit on
a compile's time: test_grammar_pending_engine.py.)

dummy:tiny ModelRunner in this process, driven as the core drives it. The compile is held shut
by the test: everything is counted in steps, never timed (HANG_GUARD_S only ends a step that
waits for a shut compile, so that such a step fails the test instead of hanging it)."""

import threading
from concurrent.futures import wait

import pytest
import torch

from tokstream.engine.messages.worker import NewRequestData, ScheduledChunk, StepPlan
from tokstream.sampling_params import SamplingParams
from tokstream.structured import StructuredOutput
from tokstream.text.tokenizer import dummy_tokenizer
from tokstream.worker.grammar import Grammars
from tokstream.worker.model_runner import ModelRunner, allocate_kv_caches

from helpers.tiny_model import tiny_model, tiny_source

BLOCK = 4
HANG_GUARD_S = 10.0
HELD_STEPS = 3
GRAMMAR = StructuredOutput("choice", '["hello world", "help me", "world peace", "wow"]').grammar()
PROMPTS = {"a": [3, 4], "g": [5, 6, 7, 8, 9, 10, 11, 12]}
""""a" samples freely, "g" under GRAMMAR."""
G_TOKENS = 4


@pytest.fixture(scope="module")
def source():
    return tiny_source()


@pytest.fixture(scope="module")
def model(source):
    return tiny_model(source)


@pytest.fixture(scope="module")
def tokenizer(source):
    config = source.config
    return dummy_tokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)


@pytest.fixture
def grammars(source, tokenizer):
    config = source.config
    return Grammars(tokenizer.to_json, config.vocab_size, config.eos_token_ids)


@pytest.fixture
def gate(monkeypatch):
    """Holds every matcher's compile until set (the grammar tokenizer builds freely)."""
    opened = threading.Event()
    compile_matcher = Grammars._compile

    def held(self, grammar):
        opened.wait(HANG_GUARD_S)
        return compile_matcher(self, grammar)

    monkeypatch.setattr(Grammars, "_compile", held)
    yield opened
    opened.set()


class Run:
    """The core's side of the steps: "a" and "g" learned at step 0, each prefilled (whole
    unless told) and then decoded one token a step; a request held back computes its last
    position again (as Scheduler.sample_again has it)."""

    def __init__(self, model, grammars, first_chunk: int | None = None):
        self.runner = ModelRunner(model, allocate_kv_caches(
            model.config, 64, BLOCK, 1, torch.float32, torch.device("cpu")), BLOCK,
            torch.device("cpu"), grammars=grammars)
        self.free = iter(range(64))
        self.tokens = {rid: list(prompt) for rid, prompt in PROMPTS.items()}
        self.computed = {rid: 0 for rid in PROMPTS}
        self.num_blocks = {rid: 0 for rid in PROMPTS}
        self.first_chunk = first_chunk
        """Tokens of "g"'s prompt in its first chunk (None: all)."""
        self.new = [NewRequestData("a", SamplingParams(temperature=0.0), 0, len(PROMPTS["a"])),
                    NewRequestData("g", SamplingParams(temperature=0.0, grammar=GRAMMAR), 0,
                                   len(PROMPTS["g"]))]
        self.live = ["a", "g"]
        self.finished: list[str] = []
        self.ends: dict[str, int] = {}
        self.step_id = 0

    def output(self, rid: str) -> list[int]:
        return self.tokens[rid][len(PROMPTS[rid]):]

    def chunk(self, rid: str) -> ScheduledChunk:
        tokens, start = self.tokens[rid], self.computed[rid]
        end = len(tokens)
        if rid == "g" and start == 0 and self.first_chunk is not None:
            end = self.first_chunk
        self.ends[rid] = end
        needed = -(-end // BLOCK) - self.num_blocks[rid]
        self.num_blocks[rid] += needed
        return ScheduledChunk(rid, tokens[start:end], start,
                              [next(self.free) for _ in range(needed)],
                              len(tokens) - len(PROMPTS[rid]) if end == len(tokens) else None)

    def step(self):
        plan = StepPlan(self.step_id, self.new, [self.chunk(rid) for rid in self.live],
                        finished_ids=self.finished)
        self.new, self.finished = [], []
        self.step_id += 1
        return self.runner.execute(plan)

    def advance(self, result) -> None:
        held = set(result.grammar_pending) | {f.request_id for f in result.grammar_failures}
        sampled = iter(result.sampled_token_ids)
        for rid in self.live:
            end = self.ends[rid]
            if end < len(self.tokens[rid]):  # a prompt chunk that samples nothing
                self.computed[rid] = end
            elif rid in held:
                self.computed[rid] = end - 1
            else:
                self.computed[rid] = end
                self.tokens[rid].append(next(sampled))
        for failure in result.grammar_failures:
            self.live.remove(failure.request_id)
            self.finished.append(failure.request_id)

    def until_g_has(self, count: int) -> None:
        while len(self.output("g")) < count:
            self.advance(self.step())


def waiting_for_every_grammar(self, sampled):
    """Grammars.hold_back as the steps had it before: wait for each compile, hold nothing."""
    wait([c.compiling for c in sampled.values() if c is not None], HANG_GUARD_S)
    return [], []


def test_a_step_samples_the_others_while_a_grammar_compiles(model, grammars, gate,
                                                            monkeypatch, source, tokenizer):
    run = Run(model, grammars)
    for _ in range(HELD_STEPS):
        result = run.step()
        assert not gate.is_set()
        assert len(result.sampled_token_ids) == 1, "the step sampled the held request"
        assert result.grammar_pending == ["g"] and not result.grammar_failures
        run.advance(result)
    assert len(run.output("a")) == HELD_STEPS and run.output("g") == []
    gate.set()
    run.runner.requests["g"].constraint.compiling.result(HANG_GUARD_S)
    run.until_g_has(G_TOKENS)

    # The same steps where each step waits for the compile (the grammar ready at step 0).
    monkeypatch.setattr(Grammars, "hold_back", waiting_for_every_grammar)
    config = source.config
    waited = Run(model, Grammars(tokenizer.to_json, config.vocab_size, config.eos_token_ids))
    waited.until_g_has(G_TOKENS)
    assert run.output("g") == waited.output("g")
    text = tokenizer.decode(run.output("g"))
    assert any(c.startswith(text) for c in ("hello world", "help me", "world peace", "wow"))
    a_steps = len(waited.output("a"))
    assert run.output("a")[:a_steps] == waited.output("a")


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(model, grammars, monkeypatch):
    def failing(self, grammar):
        raise ValueError("lexer too large")

    monkeypatch.setattr(Grammars, "_compile", failing)
    run = Run(model, grammars, first_chunk=4)  # "g" is learned at step 0, sampled at step 1
    run.advance(run.step())
    run.runner.requests["g"].constraint.compiling.exception(HANG_GUARD_S)
    result = run.step()
    assert len(result.sampled_token_ids) == 1 and result.grammar_pending == []
    [failure] = result.grammar_failures
    assert failure.request_id == "g" and "failed to compile: lexer too large" in failure.message
