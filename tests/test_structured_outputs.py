"""Structured outputs through the engine (dummy:tiny, random weights: only the grammar makes
the output valid): JSON schemas, json_object, regex, choice and Lark grammars; 40 varied
constrained generations all parse and validate; a constrained request preempted and
re-prefilled on a tiny pool ends exactly as it does alone; and bad specs are user errors."""

import json
import re

import jsonschema
import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig
from tokstream.engine.llm import LLM
from tokstream.errors import UserInputError
from tokstream.sampling_params import SamplingParams
from tokstream.structured import StructuredOutput

pytestmark = pytest.mark.startup  # starts servers or engines (make test-fast leaves it out)

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
     "required": ["name"], "additionalProperties": False},
]
PROMPTS = ["Answer in JSON.", "Give me an object", "hello", "1 2 3"]


def tiny(num_blocks=256):
    return EngineConfig(model="dummy:tiny", dtype="float32",
                        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512))


def constrained(schema, seed, temperature=1.0, max_tokens=96):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured=StructuredOutput("json_schema", json.dumps(schema)))


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny()) as engine:
        yield engine


def test_forty_constrained_generations_all_validate(llm):
    requests = [(PROMPTS[i % 4], constrained(SCHEMAS[i % 4], seed=i,
                                             temperature=(0.0, 0.7, 1.0, 1.5)[i // 10]))
                for i in range(40)]
    completions = [llm.generate([prompt], params)[0] for prompt, params in requests]
    for (prompt, params), completion in zip(requests, completions):
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), json.loads(params.structured.spec))


def test_json_object_regex_choice_and_grammar(llm):
    def run(kind, spec="", max_tokens=48):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=4,
                                structured=StructuredOutput(kind, spec))
        return llm.generate(["x"], params)[0]

    # Any object: a random model may stay inside a string past max_tokens; what it wrote is
    # then an object's beginning, and whatever ends parses.
    for seed in range(4):
        completion = llm.generate(["x"], SamplingParams(
            max_tokens=64, temperature=1.0, seed=seed, structured=StructuredOutput("json_object")))[0]
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", run("regex", r"[0-9]{3}-[a-z]{2}").text)
    assert run("choice", json.dumps(["yes", "no", "maybe"])).text in ("yes", "no", "maybe")
    tuple_ = run("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[1-9]/', max_tokens=200)
    assert re.fullmatch(r"\([1-9](,[1-9])*\)" if tuple_.finish_reason == "stop"
                        else r"\([1-9](,[1-9])*,?", tuple_.text)


def test_a_free_request_beside_a_constrained_one_is_unchanged(llm):
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True)
    alone = llm.generate(["hello"], free)[0].token_ids
    together = llm.generate(["hello", "hi"], [free, constrained(SCHEMAS[0], 1)])
    assert together[0].token_ids == alone


def test_preempted_constrained_requests_end_as_they_do_alone():
    params = [constrained(SCHEMAS[i % 4], seed=i) for i in range(6)]
    # Distinct from their first block: sharing one, all but the first would wait for it to be
    # cached (a prefix in flight) and the pool would not run dry.
    prompts = [f"{i} request " * 6 for i in range(6)]
    with LLM(tiny()) as engine:
        alone = [engine.generate([p], q)[0].text for p, q in zip(prompts, params)]
    with LLM(tiny(num_blocks=40)) as engine:
        together = [c.text for c in engine.generate(prompts, params)]
        assert engine.core.scheduler.num_preemptions > 0
    assert together == alone
    for text, p in zip(together, params):
        jsonschema.validate(json.loads(text), json.loads(p.structured.spec))


@pytest.mark.parametrize("kind,spec", [
    ("json_schema", "{not json"), ("json_schema", '{"type": "bogus"}'),
    ("regex", "(unclosed"), ("choice", "[]"), ("grammar", "start: undefined_rule"),
    ("xml", "")])
def test_bad_specs_are_user_errors(kind, spec):
    with pytest.raises(UserInputError):
        SamplingParams(structured=StructuredOutput(kind, spec))
