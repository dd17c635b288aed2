"""Reading and checking request bodies. Every failure is a 400 (413 for size) whose message
starts with the path of the field to blame, e.g. `messages.2.content.0.type: ...`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re

from starlette.requests import ClientDisconnect

from tokstream.errors import PromptTooLongError, UserInputError
from tokstream.sampling_params import SamplingParams
from tokstream.server.api_errors import ApiError, ClientGone, bad_request

log = logging.getLogger("tokstream.server")

_MISSING = object()


JSON_TYPES = ("application/json",)
"""Media types read as JSON (and any `+json` one). A browser sends text/plain or form bodies
cross-origin without a CORS preflight; refusing them keeps such pages from driving the API."""
MAX_SHOWN_CHARS = 80
"""Longest client value an error message repeats."""


async def read_json(request, max_bytes: int, timeout_s: float | None = None) -> dict:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not (media_type in JSON_TYPES or media_type.endswith("+json")):
        raise ApiError("invalid_request_error",
                       f"content-type: expected application/json, got "
                       f"{shown(media_type) if media_type else 'none'}", status=415)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError("request_too_large",
                       f"body: {shown(int(declared))} bytes exceed the limit of {max_bytes} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise ApiError("request_too_large",
                                   f"body: more than the limit of {max_bytes} bytes")
    except ClientDisconnect:
        log.info("%s %s: the client left before its body was complete", request.method,
                 request.url.path)
        raise ClientGone(request.url.path) from None
    except TimeoutError:
        raise ApiError("invalid_request_error", f"body: not received within {timeout_s:g} s",
                       status=408) from None
    request.state.body_bytes = len(body)
    if len(body) > OFFLOAD_BYTES:
        data = await asyncio.to_thread(decode_json, bytes(body))
    else:
        data = decode_json(bytes(body))
    request.state.compiles_grammar = any(name in data for name in GRAMMAR_FIELDS)
    request.state.joins_conversation = any(name in data for name in CONVERSATION_FIELDS)
    return data


def decode_json(body: bytes) -> dict:
    """A request body as a JSON object whose strings are all valid Unicode."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request("body", f"not valid UTF-8 (byte {error.start})") from None
    if not text.strip():
        raise bad_request("body", "empty; expected a JSON object")
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as error:
        raise bad_request("body", f"invalid JSON: {error.msg} at line {error.lineno} "
                                  f"column {error.colno}") from None
    except (ValueError, RecursionError) as error:
        raise bad_request("body", f"invalid JSON: {shown(str(error))}") from None
    if not isinstance(data, dict):
        raise bad_request("body", f"must be a JSON object, not {_kind(data)}")
    # Only a \uD8xx-\uDFxx escape makes a lone surrogate; the walk is skipped without one.
    if re.search(r"\\u[dD][89a-fA-F]", text):
        path = _surrogate_path(data)
        if path is not None:
            raise bad_request(path or "body", "holds a lone UTF-16 surrogate (not Unicode "
                                              "text)")
    return data


def _surrogate_path(value, path: str = "") -> str | None:
    """The dotted path of the first string (key or value) that is not valid Unicode."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                at = f"{path}.{key[:64]}" if path else key[:64]
                if not _is_unicode(key):
                    return path or "body"
                stack.append((item, at))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{n}") for n, item in reversed(list(enumerate(value))))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(value, limit: int = MAX_SHOWN_CHARS) -> str:
    """repr(value) cut to limit characters: error messages never echo a client's megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + "…" + text[-4:]


OFFLOAD_BYTES = 65536
"""Bodies larger than this are tokenised on a worker thread, so a long prompt's chat template
and tokenisation never hold up the event loop (and the streams it is writing)."""
GRAMMAR_FIELDS = ("response_format", "structured_outputs", "output_config", "output_format",
                  "tools", "text")
"""Fields whose parse compiles a grammar (StructuredOutput.grammar: llguidance validates it),
which costs what the schema asks, not what the body weighs: a 5 KB schema nested 50 deep took
8-9 ms to validate, inline on the event loop before, so a body holding one of these is parsed
on a worker thread whatever its size (`text` is the Responses API's output format)."""
CONVERSATION_FIELDS = ("thread", "previous_response_id")
"""Fields whose parse joins a conversation the server kept (a Messages API thread, a stored
Responses API response) to the body: a short body may stand for a long prompt, so it is
parsed on a worker thread too."""


async def parse_off_loop(request, parse, *args):
    """parse(*args) on a thread when the request body was large, may compile a grammar or
    joins a kept conversation, inline otherwise."""
    if getattr(request.state, "body_bytes", 0) > OFFLOAD_BYTES \
            or getattr(request.state, "compiles_grammar", False) \
            or getattr(request.state, "joins_conversation", False):
        return await asyncio.to_thread(parse, *args)
    return parse(*args)


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _kind(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def get_int(body: dict, name: str, default=None, *, required: bool = False,
            minimum: int | None = None, maximum: int | None = None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise bad_request(name, "required")
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"must be an integer, not {_kind(value)}")
    if minimum is not None and value < minimum:
        raise bad_request(name, f"must be >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise bad_request(name, f"must be <= {maximum}, got {shown(value)}")
    return value


def get_number(body: dict, name: str, default: float, *, minimum: float, maximum: float,
               exclusive_minimum: bool = False) -> float:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(name, f"must be a number, not {_kind(value)}")
    value = float(value)
    low_ok = value > minimum if exclusive_minimum else value >= minimum
    if not (math.isfinite(value) and low_ok and value <= maximum):
        bracket = "(" if exclusive_minimum else "["
        raise bad_request(name, f"must be in {bracket}{minimum:g}, {maximum:g}], got {value:g}")
    return value


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"must be a boolean, not {_kind(value)}")
    return value


MAX_STOP_CHARS = 256
"""Longest stop string: each is matched against the text for the request's life."""


def get_strings(body: dict, name: str, *, allow_single: bool, max_items: int = 16,
                max_chars: int = MAX_STOP_CHARS) -> list[str]:
    """A list of non-empty strings (or one string where allow_single), each at most
    max_chars long."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return []
    if isinstance(value, str) and allow_single:
        value = [value]
    if not isinstance(value, list):
        raise bad_request(name, f"must be {'a string or ' if allow_single else ''}an array of "
                                f"strings, not {_kind(value)}")
    if len(value) > max_items:
        raise bad_request(name, f"at most {max_items} items, got {len(value)}")
    for n, item in enumerate(value):
        if not isinstance(item, str):
            raise bad_request(f"{name}.{n}", f"must be a string, not {_kind(item)}")
        if not item:
            raise bad_request(f"{name}.{n}", "must not be empty")
        if len(item) > max_chars:
            raise bad_request(f"{name}.{n}", f"at most {max_chars} characters, got {len(item)}")
    return value


def get_messages(body: dict) -> list:
    """The required, non-empty `messages` array (both APIs)."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages", "required")
    if not isinstance(messages, list):
        raise bad_request("messages", f"must be an array, not {_kind(messages)}")
    if not messages:
        raise bad_request("messages", "must contain at least one message")
    return messages


def get_object(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise bad_request(name, f"must be an object, not {_kind(value)}")
    return value


def reject_unsupported(body: dict, checks: dict) -> None:
    """checks: {field: predicate(value) -> True when the value asks for something we don't
    do}. Silently ignoring those would return something other than what was asked."""
    for name, asks_unsupported in checks.items():
        value = body.get(name)
        if value is not None and asks_unsupported(value):
            raise bad_request(name, "not supported by this server")


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
               prompt_field: str, max_tokens_field: str = "max_tokens") -> int:
    """Check the prompt (and max_tokens) fit the context; returns max_tokens (defaulted to the
    room left when None)."""
    if num_prompt_tokens == 0:
        raise bad_request(prompt_field, "the prompt is empty")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(prompt_field, f"the prompt is {num_prompt_tokens} tokens; the model's "
                                        f"context is {max_model_len} tokens, leaving no room "
                                        "for output")
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(max_tokens_field, f"{shown(max_tokens)} + {num_prompt_tokens} prompt "
                                            f"tokens exceed the model's context of "
                                            f"{max_model_len} tokens")
    return max_tokens


def sampling_params(param_for: dict, **kwargs) -> SamplingParams:
    """SamplingParams, with its own validation errors turned into 400s on the right field."""
    try:
        return SamplingParams(**kwargs)
    except UserInputError as error:
        message = str(error)
        field = next((param_for.get(k, k) for k in kwargs if message.startswith(k)), "body")
        raise bad_request(field, message) from None


def prompt_error(error: UserInputError, field: str) -> ApiError:
    if isinstance(error, PromptTooLongError):
        return bad_request(field, str(error))
    return bad_request(field, str(error))
