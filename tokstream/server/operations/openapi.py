"""The published OpenAPI 3.1 schema (GET /openapi.json): every route, its body and its errors."""

from __future__ import annotations

import functools

from tokstream.body_bounds import body_bounds
from tokstream.checker import MAX_RESPONSE_CHOICES
from tokstream.sampling_params import SamplingParams
from tokstream.server.api.sampling_options import MAX_BAD_WORDS, MAX_TOKEN_IDS
from tokstream.state_snapshot import RequestDetail, StateSnapshot
from tokstream.wire import json_schema

TEXT_BLOCKS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}

ANTHROPIC_TOOLS = {
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"],
                                         "properties": {"name": {"type": "string"},
                                                        "description": {"type": "string"},
                                                        "input_schema": {"type": "object"}}}},
    "tool_choice": {"type": "object", "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
        "disable_parallel_tool_use": {"type": "boolean"}}},
}
"""Custom tools only; content may also hold tool_use (assistant) and tool_result (user,
text only) blocks."""

OUTPUT_FORMAT = {"type": "object", "required": ["type", "schema"], "properties": {
    "type": {"const": "json_schema"}, "schema": {"type": "object"}}}
"""Structured outputs: the output is constrained to the JSON schema."""



def bounded(api: str) -> dict:
    """The numeric sampling options api reads, from their SamplingParams fields' bounds (the
    same that the routes check: server/api/sampling_options.py bounded_options)."""
    return {name: bound.schema() for name, (bound, _) in body_bounds(SamplingParams, api).items()}


SAMPLING = {
    "ignore_eos": {"type": "boolean", "description": "tokstream/vLLM extension"},
    "stream": {"type": "boolean"},
}

MESSAGES_BODY = {
    "type": "object", "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["user", "assistant"]}, "content": TEXT_BLOCKS}}},
        "system": TEXT_BLOCKS,
        **bounded("anthropic"),
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
        "output_config": {"type": "object", "properties": {"format": OUTPUT_FORMAT, "effort": {
            "enum": ["low", "medium", "high", "xhigh", "max"]}}},
        "output_format": {**OUTPUT_FORMAT, "description": "the beta's name for "
                                                          "output_config.format"},
        "thread": {"type": "object", "description": "the message-threads beta: create keeps "
                   "the conversation under the reply's id; continue (with "
                   "previous_message_id, no system or tools) goes on from it",
                   "properties": {"type": {"enum": ["create", "continue"]},
                                  "previous_message_id": {"type": "string"}}},
        **ANTHROPIC_TOOLS,
        **SAMPLING,
    },
}

COUNT_BODY = {"type": "object", "required": ["model", "messages"],
              "properties": {k: v for k, v in MESSAGES_BODY["properties"].items()
                             if k in ("model", "messages", "system", "tools", "tool_choice")}}

OPENAI_COMMON = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    **bounded("openai"),
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "n": {"type": "integer", "minimum": 1, "maximum": 16,
          "description": "choices, each seeded seed + index"},
    "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": "boolean"},
        "continuous_usage_stats": {"type": "boolean",
                                   "description": "vLLM extension: usage on every chunk"}}},
    "logit_bias": {"type": "object", "additionalProperties": {
        "type": "number", "minimum": -100, "maximum": 100}},
    "response_format": {"type": "object", "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                         "schema": {"type": "object"},
                                                         "strict": {"type": "boolean"}}}}},
    "structured_outputs": {"type": "object", "description": "vLLM extension: one of json, "
                           "regex, choice, grammar (Lark); the older guided_json, "
                           "guided_regex, guided_choice and guided_grammar are read as these"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                       "maxItems": MAX_TOKEN_IDS, "description": "vLLM extension"},
    "allowed_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                          "maxItems": MAX_TOKEN_IDS,
                          "description": "vLLM extension: the only ids that may be sampled"},
    "bad_words": {"type": "array", "items": {"type": "string", "minLength": 1},
                  "maxItems": MAX_BAD_WORDS,
                  "description": "vLLM extension: words the output may not contain"},
    "truncate_prompt_tokens": {"type": "integer", "minimum": -1,
                               "description": "vLLM extension: keep the prompt's last N tokens "
                                              "(-1: as many as the context holds)"},
    "min_tokens": {"type": "integer", "minimum": 0,
                   "description": "vLLM extension: no end before this many output tokens"},
    "include_stop_str_in_output": {"type": "boolean", "description": "vLLM extension"},
    "skip_special_tokens": {"type": "boolean", "default": True,
                            "description": "vLLM extension"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 256,
                   "description": "vLLM extension: cached prefix blocks are shared only with "
                                  "the same tenant's requests of the same salt"},
    **SAMPLING,
}

CHAT_BODY = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        **OPENAI_COMMON,
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"enum": ["system", "developer", "user", "assistant",
                                             "tool"]},
                           "content": TEXT_BLOCKS, "tool_calls": {"type": "array"},
                           "tool_call_id": {"type": "string"}}}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"],
                                             "properties": {"type": {"const": "function"},
                                                            "function": {"type": "object"}}}},
        "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]},
                                  {"type": "object", "properties": {
                                      "type": {"const": "function"},
                                      "function": {"type": "object"}}}]},
        "parallel_tool_calls": {"type": "boolean"},
        "add_generation_prompt": {"type": "boolean", "default": True,
                                  "description": "vLLM extension: open the assistant's turn"},
        "continue_final_message": {"type": "boolean", "default": False,
                                   "description": "vLLM extension: continue the final "
                                                  "(assistant) message, a prefill; needs "
                                                  "add_generation_prompt false"},
        "chat_template_kwargs": {"type": "object",
                                 "description": "vLLM extension: further variables for the "
                                                "model's chat template"},
    },
}

RESPONSES_BODY = {
    "type": "object", "required": ["model", "input"],
    "properties": {
        "model": {"type": "string"}, "stream": {"type": "boolean"},
        "instructions": {"type": ["string", "null"]},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {
            "type": "object", "properties": {
                "type": {"enum": ["message", "function_call", "function_call_output",
                                  "reasoning"]},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array"}]},
                "call_id": {"type": "string"}, "name": {"type": "string"},
                "arguments": {"type": "string"}, "output": {"type": "string"}}}}]},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "include": {"type": "array", "items": {"type": "string"}},
        "text": {"type": "object", "properties": {"format": {"type": "object", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "name": {"type": "string"}, "schema": {"type": "object"}}}}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"],
                                             "properties": {"type": {"const": "function"},
                                                            "name": {"type": "string"},
                                                            "parameters": {"type": "object"}}}},
        "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]},
                                  {"type": "object", "properties": {
                                      "type": {"const": "function"},
                                      "name": {"type": "string"}}}]},
        "parallel_tool_calls": {"type": "boolean"},
        "store": {"type": "boolean", "description": "keep the response (default true) for "
                                                    "previous_response_id and GET"},
        "previous_response_id": {"type": "string"},
        "metadata": {"type": "object"},
    },
}

RESPONSE_ID = {"name": "response_id", "in": "path", "required": True,
               "schema": {"type": "string"}}

COMPLETION_BODY = {
    "type": "object", "required": ["model", "prompt"],
    "properties": {**OPENAI_COMMON,
                   "max_tokens": {"type": "integer", "minimum": 0,
                                  "description": "0 only with echo: the prompt alone"},
                   "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                   "echo": {"type": "boolean",
                            "description": "the prompt before the output (with logprobs: its "
                                           "tokens lead the lists, the first null)"},
                   "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": 20,
                                       "description": "vLLM extension: choices[]."
                                                      "prompt_logprobs; not streamed"},
                   "prompt": {"oneOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "minItems": 1, "maxItems": MAX_RESPONSE_CHOICES, "items": {"oneOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
         "description": "a batch: prompt p's n choices are indices p*n to p*n + n - 1"}]}},
}

TOKENIZE_BODY = {
    "type": "object", "description": "vLLM's shape: a prompt, or messages",
    "properties": {"model": {"type": "string"}, "prompt": {"type": "string"},
                   "messages": CHAT_BODY["properties"]["messages"],
                   "add_special_tokens": {"type": "boolean"},
                   "add_generation_prompt": {"type": "boolean"}}}

DETOKENIZE_BODY = {
    "type": "object", "required": ["tokens"],
    "properties": {"model": {"type": "string"},
                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}

BATCH_BODY = {
    "type": "object", "required": ["requests"],
    "properties": {"requests": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["custom_id", "params"],
        "properties": {"custom_id": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                       "params": {**MESSAGES_BODY, "description": "a /v1/messages body, "
                                  "checked when it runs (a bad one is an errored result)"}}}}}}
BATCH_ID = {"name": "message_batch_id", "in": "path", "required": True,
            "schema": {"type": "string"}}

SCORE_BODY = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2},
        "start": {"type": "integer", "minimum": 1},
        "prompt_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "output_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}

ANTHROPIC_ERROR = {"type": "object", "properties": {"type": {"const": "error"}, "error": {
    "type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
OPENAI_ERROR = {"type": "object", "properties": {"error": {
    "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                     "param": {"type": ["string", "null"]},
                                     "code": {"type": ["integer", "null"]}}}}}


def _post(summary: str, body: dict, error: dict, streams: bool, overload: int) -> dict:
    content = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    errors = {str(code): {"description": text, "content": {"application/json":
                                                           {"schema": error}}}
              for code, text in ((400, "invalid request (the message names the field)"),
                                 (401, "missing or unknown API key"), (404, "unknown model"),
                                 (413, "body too large"),
                                 (429, "tenant rate or concurrency limit (retry-after)"),
                                 (overload, "overloaded or replica down (retry-after)"))}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {"application/json": {"schema": body}}},
                     "responses": {"200": {"description": "OK", "content": content}, **errors}}}


def _get(summary: str, description: str = "OK", schema: dict | None = None) -> dict:
    ok = {"description": description}
    if schema is not None:
        ok["content"] = {"application/json": {"schema": schema}}
    return {"get": {"summary": summary, "responses": {"200": ok}}}


@functools.cache
def openapi_schema() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokstream", "version": "0.1.0",
                 "description": "Anthropic- and OpenAI-compatible LLM serving. Every stream "
                                "carries a `tokstream` integrity extension."},
        "paths": {
            "/v1/messages": _post("Anthropic Messages API", MESSAGES_BODY, ANTHROPIC_ERROR,
                                  True, 529),
            "/v1/messages/count_tokens": _post("Count prompt tokens", COUNT_BODY,
                                               ANTHROPIC_ERROR, False, 529),
            "/v1/messages/batches": {
                **_post("Create a Message Batch: run below interactive requests, results "
                        "later", BATCH_BODY, ANTHROPIC_ERROR, False, 529),
                **_get("The caller's Message Batches, newest first (limit, after_id, "
                       "before_id)")},
            "/v1/messages/batches/{message_batch_id}": {
                **_get("A Message Batch (the caller's own)"),
                "delete": {"summary": "Delete an ended Message Batch",
                           "responses": {"200": {"description": "deleted"}}},
                "parameters": [BATCH_ID]},
            "/v1/messages/batches/{message_batch_id}/cancel": {
                "post": {"summary": "Cancel a Message Batch: requests not yet done end as "
                                    "canceled", "responses": {"200": {"description": "OK"}}},
                "parameters": [BATCH_ID]},
            "/v1/messages/batches/{message_batch_id}/results": {
                **_get("An ended Message Batch's results, one JSON line per request"),
                "parameters": [BATCH_ID]},
            "/v1/chat/completions": _post("OpenAI chat completions", CHAT_BODY, OPENAI_ERROR,
                                          True, 503),
            "/v1/completions": _post("OpenAI completions", COMPLETION_BODY, OPENAI_ERROR,
                                     True, 503),
            "/v1/responses": _post("OpenAI Responses API", RESPONSES_BODY, OPENAI_ERROR, True,
                                   503),
            "/v1/responses/{response_id}": {
                **_get("A stored response (the caller's own)"),
                "delete": {"summary": "Delete a stored response",
                           "responses": {"200": {"description": "deleted"}}},
                "parameters": [RESPONSE_ID]},
            "/v1/responses/{response_id}/input_items": {
                **_get("The items a stored response answered (limit, order, after)"),
                "parameters": [RESPONSE_ID]},
            "/v1/score": _post("Teacher-forced re-scoring (admin)", SCORE_BODY, OPENAI_ERROR,
                               False, 503),
            "/tokenize": _post("Prompt or messages to token ids (vLLM)", TOKENIZE_BODY,
                               OPENAI_ERROR, False, 503),
            "/detokenize": _post("Token ids to text (vLLM)", DETOKENIZE_BODY, OPENAI_ERROR,
                                 False, 503),
            "/tokenizer_info": _get("The tokenizer's config: special tokens, chat template, "
                                    "model_max_length (vLLM)"),
            "/v1/models": _get("Served models (Anthropic's shape with anthropic-version)"),
            "/v1/models/{model_id}": {**_get("The served model by any of its names"),
                                      "parameters": [{"name": "model_id", "in": "path",
                                                      "required": True,
                                                      "schema": {"type": "string"}}]},
            "/health": _get("200 ready; 503 recovering or down"),
            "/health/live": _get("200 whenever the gateway answers"),
            "/health/ready": _get("200 while new requests are welcome; 503 recovering, down "
                                  "or draining"),
            "/metrics": _get("Prometheus metrics"),
            "/v1/state": _get("State snapshot (admin)", schema=json_schema(StateSnapshot)),
            "/v1/state/requests/{request_id}": {
                **_get("One live request with its recent text (admin)",
                       schema=json_schema(RequestDetail)),
                "parameters": [{"name": "request_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}]},
            "/openapi.json": _get("This schema"),
        },
    }
