"""Anthropic structured outputs: the Messages API's `output_config.format`
(`{"type": "json_schema", "schema": {...}}`, what the official SDK sends for
`client.messages.parse(output_format=Model)`), and the same object as the top-level
`output_format` that the API's beta took first, read into the StructuredOutput that OpenAI's
`response_format` json_schema gives: one grammar constrains both APIs' output, and it follows
the request through a resume as every SamplingParams field does."""

from __future__ import annotations

import json

from tokstream.errors import UserInputError
from tokstream.server.api_errors import bad_request
from tokstream.server.validation import _kind, get_object, shown
from tokstream.structured import StructuredOutput

EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""output_config.effort as the API takes it (accepted; a local model has one effort)."""


def output_sampling(body: dict) -> dict:
    """SamplingParams arguments for the body's output format (none: {}), its grammar compiled
    here so a schema the grammar engine refuses is a 400 on its field."""
    found = output_format(body)
    if found is None:
        return {}
    field, structured = found
    try:
        return {"structured": structured, "grammar": structured.grammar()}
    except UserInputError as error:
        raise bad_request(f"{field}.schema", str(error)) from None


def output_format(body: dict) -> tuple[str, StructuredOutput] | None:
    """(the field it came in, the structured output) of the body's output format."""
    config = get_object(body, "output_config") or {}
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request("output_config.effort", f"must be one of {', '.join(EFFORTS)}, got "
                                                  f"{shown(effort)}")
    nested, legacy = config.get("format"), body.get("output_format")
    if nested is not None and legacy is not None:
        raise bad_request("output_format", "give output_config.format or output_format, "
                                           "not both")
    if nested is not None:
        return "output_config.format", read_format(nested, "output_config.format")
    if legacy is not None:
        return "output_format", read_format(legacy, "output_format")
    return None


def read_format(spec, field: str) -> StructuredOutput:
    if not isinstance(spec, dict):
        raise bad_request(field, f"must be an object, not {_kind(spec)}")
    if spec.get("type") != "json_schema":
        raise bad_request(f"{field}.type", f"must be 'json_schema', got {shown(spec.get('type'))}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{field}.schema", "required: a JSON schema object")
    return StructuredOutput("json_schema", json.dumps(schema))
