"""The OpenAI and vLLM sampling options beyond temperature/top_p/top_k/stop/seed, read from a
request body into SamplingParams arguments: presence/frequency/repetition penalties, min_p,
logit_bias, logprobs (chat: `logprobs` + `top_logprobs`; completions: an integer), and
structured outputs (`response_format`, vLLM's `structured_outputs` and its older `guided_*`
fields), and vLLM's `stop_token_ids`, `allowed_token_ids`, `bad_words`, `skip_special_tokens`,
`include_stop_str_in_output` and `min_tokens`.
Each bad value is a 400 naming its field; a vLLM extension tokstream does not do is a 400 too
(VLLM_UNSUPPORTED)."""

from __future__ import annotations

import json
import math

from tokstream.body_bounds import body_bounds
from tokstream.errors import UserInputError
from tokstream.sampling_params import MAX_LOGPROBS, SamplingParams
from tokstream.server.api_errors import bad_request
from tokstream.server.validation import (_kind, get_bool, get_int, get_number, get_object,
                                         get_strings, reject_unsupported)
from tokstream.structured import StructuredOutput

MAX_TOKEN_IDS = 4096
"""Most stop or allowed token ids a request lists: more is a cost on every step, not a
choice."""


def bounded_options(body: dict, api: str) -> dict:
    """Every numeric sampling option api reads (temperature, top_p, top_k, seed, and on OpenAI
    routes the penalties and min_p), each checked against the bounds its SamplingParams field
    declares (tokstream/body_bounds.py): a 400 naming the field when out of them."""
    out = {}
    for name, (bound, default) in body_bounds(SamplingParams, api).items():
        if bound.integer:
            out[name] = get_int(body, name, default, minimum=bound.minimum,
                                maximum=bound.maximum)
        else:
            out[name] = get_number(body, name, default, minimum=bound.minimum,
                                   maximum=math.inf if bound.maximum is None else bound.maximum,
                                   exclusive_minimum=bound.exclusive_minimum)
    return out


VLLM_UNSUPPORTED = {
    "use_beam_search": bool,
    "length_penalty": lambda v: v != 1,
    "return_tokens_as_token_ids": bool,
    "prompt_embeds": bool,
    "mm_processor_kwargs": bool,
    "documents": bool,
    "structural_tag": bool,
    "kv_transfer_params": bool,
    "vllm_xargs": bool,
    "priority": lambda v: v != 0,  # tenants' priority tiers order requests here
    # Other servers' samplers (TGI's typical_p, once vLLM's too; koboldcpp's top_a): another
    # distribution than the one asked for.
    "typical_p": lambda v: v != 1,
    "top_a": lambda v: v != 0,
}
"""vLLM's sampling and request extensions tokstream does not do: asking for one is a 400
naming it (reject_unsupported), never silently ignored."""

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
"""vLLM's older structured-output fields, read as the structured_outputs key they became."""


def sampling_extras(body: dict, chat: bool, tokenizer) -> dict:
    reject_unsupported(body, VLLM_UNSUPPORTED)
    vocab_size = tokenizer.vocab_size
    extras = {
        "logit_bias": logit_bias(body, vocab_size),
        "logprobs": chat_logprobs(body) if chat else get_int(body, "logprobs", None, minimum=0,
                                                             maximum=MAX_LOGPROBS),
        "stop_token_ids": token_ids(body, "stop_token_ids", vocab_size),
        "allowed_token_ids": token_ids(body, "allowed_token_ids", vocab_size),
        "bad_words_token_ids": bad_words_token_ids(body, tokenizer),
        "skip_special_tokens": get_bool(body, "skip_special_tokens", True),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output"),
        "min_tokens": get_int(body, "min_tokens", 0, minimum=0),
    }
    structured = response_format(body)
    vllm, vllm_field = structured_outputs(body)
    if structured is not None and vllm is not None:
        raise bad_request(vllm_field, "give response_format or structured_outputs, not both")
    structured = structured or vllm
    if structured is not None:
        field = "response_format" if vllm is None else vllm_field
        try:  # compiled once here, so a bad schema is a 400 on its own field
            extras["grammar"] = structured.grammar()
        except UserInputError as error:
            raise bad_request(field, str(error)) from None
    extras["structured"] = structured
    return extras


def chat_logprobs(body: dict) -> int | None:
    wanted = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def token_ids(body: dict, name: str, vocab_size: int) -> list[int]:
    """vLLM's `stop_token_ids` (token ids that end the output, beside the model's own) or
    `allowed_token_ids` (the only ones that may be sampled): at most MAX_TOKEN_IDS ids."""
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOKEN_IDS:
        raise bad_request(name, f"must be an array of at most {MAX_TOKEN_IDS} token ids")
    for n, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise bad_request(f"{name}.{n}", f"must be a token id in [0, {vocab_size})")
    return list(value)


MAX_BAD_WORDS = 64


def bad_words_token_ids(body: dict, tokenizer) -> list[list[int]]:
    """vLLM's `bad_words`, as the token sequences the output may not contain: each word
    tokenised as it would start the text and after a space (the usual way it appears inside
    one)."""
    words = get_strings(body, "bad_words", allow_single=False, max_items=MAX_BAD_WORDS)
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode_text(text) if text.strip() else []
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    biases = get_object(body, "logit_bias") or {}
    out = {}
    for key, value in biases.items():
        field = f"logit_bias.{key}"[:80]
        try:
            token = int(key)
        except ValueError:
            raise bad_request(field, "keys must be token ids") from None
        if not 0 <= token < vocab_size:
            raise bad_request(field, f"token id outside the vocabulary [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise bad_request(field, "must be a number in [-100, 100]")
        out[token] = float(value)
    return out


def response_format(body: dict) -> StructuredOutput | None:
    spec = get_object(body, "response_format")
    if spec is None:
        return None
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        schema = (spec.get("json_schema") or {})
        if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict):
            raise bad_request("response_format.json_schema.schema", "must be an object")
        return StructuredOutput("json_schema", json.dumps(schema.get("schema", {})))
    raise bad_request("response_format.type",
                      "must be 'text', 'json_object' or 'json_schema', not " + _kind(kind))


def structured_outputs(body: dict) -> tuple[StructuredOutput | None, str]:
    """vLLM's structured_outputs (or its older guided_* fields), and the field a bad one is
    named by."""
    spec = get_object(body, "structured_outputs")
    guided = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if guided and spec is not None:
        raise bad_request(guided[0], "give structured_outputs or the guided_ fields, not both")
    if guided:
        spec = {GUIDED_FIELDS[name]: body[name] for name in guided}
        names = {GUIDED_FIELDS[name]: name for name in guided}
        field = guided[0]
    else:
        names = {key: f"structured_outputs.{key}" for key in GUIDED_FIELDS.values()}
        field = "structured_outputs"
    if spec is None:
        return None, field
    given = [k for k in ("json", "regex", "choice", "grammar") if spec.get(k) is not None]
    if len(given) != 1:
        raise bad_request(field, "give exactly one of json, regex, choice or grammar")
    key = given[0]
    value = spec[key]
    if key == "json":
        return StructuredOutput("json_schema", value if isinstance(value, str)
                                else json.dumps(value)), field
    if key == "choice":
        if not isinstance(value, list):
            raise bad_request(names[key], "must be an array of strings")
        return StructuredOutput("choice", json.dumps(value)), field
    if not isinstance(value, str):
        raise bad_request(names[key], "must be a string")
    return StructuredOutput(key, value), field
