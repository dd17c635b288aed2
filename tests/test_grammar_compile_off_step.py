"""Issue 31 item 4 (a): a constrained request's grammar is built off the steps' path. The
grammar tokenizer and the request's matcher are built on the rank's grammar threads, so steps
carrying the other streams run while they are pending (and no step samples the constrained
request before its matcher is ready: test_grammar_held_back.py). Counted by the order of
events, never timed: the tokenizer's source is held shut until the other streams have run
their steps."""

import threading

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
"""Only so that a step waiting for the shut source ends the test instead of hanging it: the
source then opens itself and the order of events shows the step waited."""


@pytest.fixture(scope="module")
def source():
    return tiny_source()


@pytest.fixture(scope="module")
def model(source):
    return tiny_model(source)


def test_other_streams_decode_while_a_grammar_is_built(source, model):
    config = source.config
    tokenizer = dummy_tokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)
    events: list[str] = []
    source_open = threading.Event()

    def tokenizer_json() -> str:  # the rank's tokenizer file, read only once it is opened
        source_open.wait(HANG_GUARD_S)
        events.append("grammar tokenizer read")
        return tokenizer.to_json()

    grammars = Grammars(tokenizer_json, config.vocab_size, config.eos_token_ids)
    caches = allocate_kv_caches(config, 32, BLOCK, 1, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, torch.device("cpu"), grammars=grammars)
    grammar = StructuredOutput("choice", '["hello"]').grammar()
    free = iter(range(32))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]  # "g": prefilled 2 tokens a step, 4 steps
    # Step 0: "a" prefills; "g" (constrained) is learned and prefills its first chunk.
    plan = StepPlan(0, [NewRequestData("a", SamplingParams(temperature=0.0), 0),
                        NewRequestData("g", SamplingParams(temperature=0.0, grammar=grammar), 0,
                                       num_prompt_tokens=len(prompt))],
                    [ScheduledChunk("a", [3, 4], 0, [next(free)], 0),
                     ScheduledChunk("g", prompt[:2], 0, [next(free), next(free)], None)])
    token_a = runner.execute(plan).sampled_token_ids[0]
    events.append("step 0")
    # Steps 1-2: "a" decodes beside "g"'s next prompt chunks (nothing of "g" sampled).
    for step in (1, 2):
        plan = StepPlan(step, chunks=[
            ScheduledChunk("a", [token_a], 1 + step, [next(free)] if step == 2 else [], step),
            ScheduledChunk("g", prompt[2 * step:2 * step + 2], 2 * step, [], None)])
        token_a = runner.execute(plan).sampled_token_ids[0]
        events.append(f"step {step}")
    source_open.set()
    # A step samples "g" only once its grammar is ready (test_grammar_held_back.py covers the
    # steps before): here it is let finish, so that step 3 samples it.
    runner.requests["g"].constraint.compiling.result(HANG_GUARD_S)
    # Step 3: "g"'s last chunk samples its first token, under its grammar.
    plan = StepPlan(3, chunks=[ScheduledChunk("a", [token_a], 4, [], 3),
                               ScheduledChunk("g", prompt[6:], 6, [], 0)])
    first_g = runner.execute(plan).sampled_token_ids[1]
    events.append("step 3")
    assert events == ["step 0", "step 1", "step 2", "grammar tokenizer read", "step 3"]
    assert runner.requests["g"].constraint.compiled
    assert tokenizer.decode([first_g]) == "h"  # the only token "hello" can start with
