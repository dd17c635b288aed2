"""Reading and checking request bodies. Every failure is a 400 (413 for size) whose message
starts with the path of the field to blame, e.g. `messages.2.content.0.type: ...`."""

from __future__ import annotations

import json
import math

from tokstream.errors import PromptTooLongError, UserInputError
from tokstream.sampling_params import SamplingParams
from tokstream.server.errors import ApiError, bad_request

_MISSING = object()


async def read_json(request, max_bytes: int) -> dict:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError("request_too_large",
                       f"body: {declared} bytes exceed the limit of {max_bytes} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError("request_too_large",
                           f"body: more than the limit of {max_bytes} bytes")
    request.state.body_bytes = len(body)
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
        raise bad_request("body", f"invalid JSON: {error}") from None
    if not isinstance(data, dict):
        raise bad_request("body", f"must be a JSON object, not {_kind(data)}")
    return data


OFFLOAD_BYTES = 65536
"""Bodies larger than this are tokenised on a worker thread, so a long prompt's chat template
and tokenisation never hold up the event loop (and the streams it is writing)."""


async def parse_off_loop(request, parse, *args):
    """parse(*args) on a thread when the request body was large, inline otherwise."""
    if getattr(request.state, "body_bytes", 0) > OFFLOAD_BYTES:
        import asyncio
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
        raise bad_request(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise bad_request(name, f"must be <= {maximum}, got {value}")
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


def get_strings(body: dict, name: str, *, allow_single: bool, max_items: int = 16) -> list[str]:
    """A list of non-empty strings (or one string where allow_single)."""
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
               prompt_field: str) -> int:
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
        raise bad_request("max_tokens", f"{max_tokens} + {num_prompt_tokens} prompt tokens "
                                        f"exceed the model's context of {max_model_len} tokens")
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
