"""An OpenAI Responses API body (POST /v1/responses) read into a Prompt: `instructions` and
`input` (a string, or items: messages, past `function_call`s and their
`function_call_output`s) as the chat the model is shown, `tools` and `tool_choice` as a
ToolRequest, `text.format` as a structured output, and the sampling options.

A request continues a stored response (conversation_store.py) with `previous_response_id`: that
response's conversation (its input and output items) comes before the new input. Fields that
need what this server keeps nowhere (`conversation`, a saved `prompt`, `item_reference`
items, `background`) are refused with a 400 naming them. Every other field the API defines is
read and checked, or refused where honouring it needs something this server does not do
(built-in tools, images and files, reasoning effort on a model that does not reason)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokstream.sampling_params import MAX_LOGPROBS
from tokstream.server.tool_calls.openai_tools import (history_arguments,
                                                     tool_request as openai_tool_request)
from tokstream.server.api.sampling_options import bounded_options
from tokstream.server.tool_calls.tool_template import encode_chat
from tokstream.server.tool_calls.tools import ToolRequest, read_function, tool_sampling
from tokstream.server.api.responses_output import CALL_ITEM_PREFIX, MESSAGE_ID_PREFIX, item_id
from tokstream.server.api.conversation_store import ConversationStore, json_size
from tokstream.server.api_errors import ApiError, bad_request
from tokstream.server.submit import Prompt
from tokstream.server.validation import (_kind, check_fits, get_bool, get_int, get_object,
                                         sampling_params, shown)
from tokstream.errors import UserInputError
from tokstream.structured import StructuredOutput

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one `include` value that changes what this server returns (each output_text part's
token logprobs); the others name data of built-in tools or stored reasoning, which it never
has, and are accepted as asking for nothing."""
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content", "code_interpreter_call.outputs",
            "computer_call_output.output.image_url", "file_search_call.results",
            "message.input_image.image_url", "web_search_call.action.sources",
            "web_search_call.results")
KEPT_NOWHERE = ("conversation", "prompt")
"""Fields that name something stored that this server does not keep (a conversation object,
a saved prompt)."""
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
              "assistant": ("output_text", "input_text", "refusal")}
"""The content parts each role's message may hold (an assistant's past output_text comes back
as the history of a conversation)."""
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
          "temperature", "top_p", "top_logprobs", "truncation", "user", "safety_identifier",
          "prompt_cache_key", "service_tier")
"""Request fields the response object repeats as they came (the API's own defaults where
absent: see response_fields)."""


@dataclass(frozen=True)
class ResponseRequest:
    """A read Responses API request: its prompt, and what the response object repeats."""

    prompt: Prompt
    fields: dict
    """The request's settings as the response object shows them (model, instructions, tools,
    tool_choice, text, store, ...)."""
    logprobs: bool
    """Whether each output_text part lists its tokens' logprobs (include)."""
    input_items: list[dict]
    """The conversation answered, as items (a previous response's, then this input), kept
    with the response when it is stored."""
    input_size: int
    """Bytes input_items take in the store (measured here, off the event loop; 0 when the
    response is not to be stored)."""


def parse(body: dict, server, store: ConversationStore, owner: str) -> ResponseRequest:
    """store and owner: where a previous_response_id is looked up, and whose it must be."""
    server.check_model(body.get("model"))
    refuse_unsupported(body, server.model_id)
    stored = get_bool(body, "store", True) and store.enabled
    conversation = previous_conversation(body, store, owner) + input_items(body)
    stream = get_bool(body, "stream")
    get_object(body, "stream_options")
    max_tokens = get_int(body, "max_output_tokens", None, minimum=1)
    options = bounded_options(body, "openai")
    options["top_k"] = max(options["top_k"], 0)
    logprobs = LOGPROBS_INCLUDE in includes(body)
    top = get_int(body, "top_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    structured, text = text_format(body)
    tools = tool_request(body)
    extras = {"structured": structured, "logprobs": (top or 0) if logprobs else None}
    if structured is not None:
        try:  # compiled here, so a schema the grammar engine refuses is a 400 on its field
            extras["grammar"] = structured.grammar()
        except UserInputError as error:
            raise bad_request("text.format.schema", str(error)) from None
    extras.update(tool_sampling(tools, structured))
    try:
        token_ids = encode_chat(server.tokenizer, chat_messages(body, conversation),
                                tools.tools if tools else (), limit=server.max_model_len)
    except UserInputError as error:
        raise bad_request("input", str(error)) from None
    max_tokens = check_fits(len(token_ids), max_tokens, server.max_model_len, "input",
                            "max_output_tokens")
    params = sampling_params({"max_tokens": "max_output_tokens", "structured": "text.format"},
                             max_tokens=max_tokens, ignore_eos=get_bool(body, "ignore_eos"),
                             **options, **extras)
    fields = response_fields(body, tools, text, stored)
    return ResponseRequest(Prompt(token_ids, params, stream, tools=tools), fields, logprobs,
                           conversation, json_size(conversation) if stored else 0)


def refuse_unsupported(body: dict, model_id: str) -> None:
    """A 400 naming the first field that asks for what this server does not do; the
    metadata and string fields it repeats checked."""
    for name in KEPT_NOWHERE:
        if body.get(name) is not None:
            raise bad_request(name, "not kept by this server: send the conversation in input, "
                                    "or continue a stored response with previous_response_id")
    if get_bool(body, "background"):
        raise bad_request("background", "background responses are not run here (stream, or "
                                        "wait for the answer)")
    reasoning = get_object(body, "reasoning") or {}
    if reasoning.get("effort") not in (None, "none"):
        raise bad_request("reasoning.effort", f"{model_id} is not a reasoning model")
    truncation = body.get("truncation") or "disabled"
    if truncation != "disabled":
        raise bad_request("truncation", f"only 'disabled' is supported (a conversation past "
                                        f"the context is a 400), got {shown(truncation)}")
    if get_int(body, "max_tool_calls", None, minimum=1) is not None:
        raise bad_request("max_tool_calls", "not supported by this server (parallel_tool_calls: "
                                            "false allows one call)")
    metadata(body)
    for name in ("user", "safety_identifier", "prompt_cache_key", "service_tier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(name, f"must be a string, not {_kind(body[name])}")


def previous_conversation(body: dict, store: ConversationStore, owner: str) -> list[dict]:
    """The conversation of the response previous_response_id names (none: [])."""
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise bad_request("previous_response_id", f"must be a string, not {_kind(previous)}")
    found = stored_response(store, owner, previous)
    if found is None:
        kept = "responses are kept in the gateway's memory, within --conversation-store-bytes" \
            if store.enabled else "this server keeps none (--conversation-store-bytes 0)"
        raise ApiError("not_found_error", f"previous_response_id: no stored response "
                                          f"{shown(previous)} ({kept})",
                       param="previous_response_id")
    return found["input_items"] + found["response"]["output"]


def stored_response(store: ConversationStore, owner: str, response_id: str) -> dict | None:
    """{"response", "input_items"}: a stored response and the conversation it answered (the
    previous one's input and output items, then its own input), if the owner has it."""
    record = store.get(owner, response_id)
    return record if record is not None and record.get("kind") == "response" else None


def store_response(store: ConversationStore, owner: str, response: dict,
                   asked: ResponseRequest) -> None:
    """Keep a finished response with the conversation it answered."""
    store.put(owner, response["id"], {"kind": "response", "response": response,
                                      "input_items": asked.input_items},
              asked.input_size + json_size(response))


def metadata(body: dict) -> dict:
    value = get_object(body, "metadata") or {}
    if len(value) > 16:
        raise bad_request("metadata", f"at most 16 keys, got {len(value)}")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise bad_request(f"metadata.{key}"[:80], "keys are at most 64 characters and "
                                                      "values strings of at most 512")
    return value


def includes(body: dict) -> list[str]:
    value = body.get("include") or []
    if not isinstance(value, list):
        raise bad_request("include", f"must be an array, not {_kind(value)}")
    for n, item in enumerate(value):
        if item not in INCLUDES:
            raise bad_request(f"include.{n}", f"must be one of {', '.join(INCLUDES)}, got "
                                              f"{shown(item)}")
    return value


def text_format(body: dict) -> tuple[StructuredOutput | None, dict]:
    """The structured output `text.format` asks for (None for plain text) and the `text`
    object the response repeats."""
    text = get_object(body, "text") or {}
    spec = text.get("format") or {"type": "text"}
    if not isinstance(spec, dict):
        raise bad_request("text.format", f"must be an object, not {_kind(spec)}")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "low", "medium", "high"):
        raise bad_request("text.verbosity", f"must be low, medium or high, got {shown(verbosity)}")
    shown_text = {"format": spec, **({"verbosity": verbosity} if verbosity else {})}
    kind = spec.get("type")
    if kind == "text":
        return None, shown_text
    if kind == "json_object":
        return StructuredOutput("json_object"), shown_text
    if kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("text.format.schema", "required: a JSON schema object")
        if not isinstance(spec.get("name"), str):
            raise bad_request("text.format.name", "required")
        return StructuredOutput("json_schema", json.dumps(schema)), shown_text
    raise bad_request("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got "
                                          f"{shown(kind)}")


def tool_request(body: dict) -> ToolRequest | None:
    """The request's function tools and tool_choice (None: no tools, or tool_choice none):
    chat's rules, with the Responses API's flat tool and named-choice shapes."""
    return openai_tool_request(body, read_tool, named_at=("name",))


def read_tool(item, path: str):
    if not isinstance(item, dict):
        raise bad_request(path, f"must be an object, not {_kind(item)}")
    if item.get("type") != "function":
        raise bad_request(f"{path}.type", f"only 'function' tools are supported (no built-in "
                                          f"tools here), got {shown(item.get('type'))}")
    return read_function(item.get("name"), item.get("description"), item.get("parameters"),
                         path, "parameters")


def input_items(body: dict) -> list[dict]:
    """`input` as items, each checked, with its type and an id (a string input is one user
    message)."""
    value = body.get("input")
    if value is None:
        raise bad_request("input", "required")
    if isinstance(value, str):
        value = [{"role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise bad_request("input", f"must be a string or an array of items, not {_kind(value)}")
    if not value:
        raise bad_request("input", "must contain at least one item")
    items = []
    for n, item in enumerate(value):
        at = f"input.{n}"
        if not isinstance(item, dict):
            raise bad_request(at, f"must be an object, not {_kind(item)}")
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            raise bad_request(f"{at}.type", "must be message, function_call, "
                                            "function_call_output or reasoning (no built-in "
                                            f"tools or stored items here), got {shown(kind)}")
        READ_ITEM[kind](item, at)  # checked here: a stored item is read again later
        items.append({**item, "type": kind,
                      "id": item.get("id") or item_id(ITEM_ID_PREFIX[kind])})
    return items


def chat_messages(body: dict, items: list[dict]) -> list[dict]:
    """`instructions` and the conversation's items as chat messages in transformers' shape: a
    turn's function_call items become its assistant message's tool_calls, their outputs tool
    messages; reasoning items (another model's, replayed by its client) show nothing."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions", f"must be a string, not {_kind(instructions)}")
    chat = [{"role": "system", "content": instructions}] if instructions else []
    for n, item in enumerate(items):
        at = f"input.{n}"
        kind = item["type"]
        if kind == "message":
            chat.append(message(item, at))
        elif kind == "function_call":
            call = function_call(item, at)
            last = chat[-1] if chat else None
            if last is None or last["role"] != "assistant" or "tool_call_id" in last:
                last = {"role": "assistant", "content": ""}
                chat.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            chat.append(call_output(item, at))
    if all(m["role"] == "system" for m in chat):
        raise bad_request("input", "holds no message, call or call output")
    return chat


def message(item: dict, at: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{at}.role", f"must be one of {', '.join(ROLES)}, got {shown(role)}")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for n, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            text = part.get("refusal" if kind == "refusal" else "text") if kind else None
            if kind not in TEXT_PARTS[role] or not isinstance(text, str):
                what = "images and files are" if kind in ("input_image", "input_file") \
                    else f"{shown(kind)} is"
                raise bad_request(f"{at}.content.{n}", f"{what} not supported in a {role} "
                                                       f"message; only "
                                                       f"{' and '.join(TEXT_PARTS[role])} parts")
            parts.append(text)
        text = "".join(parts)
    else:
        raise bad_request(f"{at}.content", f"must be a string or an array of content parts, "
                                           f"not {_kind(content)}")
    return {"role": "system" if role == "developer" else role, "content": text}


def function_call(item: dict, at: str) -> dict:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_request(f"{at}.{name}", "required: a string")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": history_arguments(item["arguments"])}}


def call_output(item: dict, at: str) -> dict:
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{at}.call_id", "required: the call_id of the call answered")
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for n, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") != "input_text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{at}.output.{n}", "only input_text parts are supported")
            texts.append(part["text"])
        output = "".join(texts)
    if not isinstance(output, str):
        raise bad_request(f"{at}.output", f"must be a string or an array of input_text parts, "
                                          f"not {_kind(output)}")
    return {"role": "tool", "content": output, "tool_call_id": item["call_id"]}


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
READ_ITEM = {"message": message, "function_call": function_call,
             "function_call_output": call_output, "reasoning": lambda item, at: None}
"""Each item type's reader (raises a 400 naming the field of a bad item)."""
ITEM_ID_PREFIX = {"message": MESSAGE_ID_PREFIX, "function_call": CALL_ITEM_PREFIX,
                  "function_call_output": "fco_", "reasoning": "rs_"}


def response_fields(body: dict, tools: ToolRequest | None, text: dict, stored: bool) -> dict:
    """The request's settings as a response object repeats them, the API's defaults where a
    field was not given."""
    fields = {name: body.get(name) for name in ECHOED}
    fields["metadata"] = fields["metadata"] or {}
    fields["parallel_tool_calls"] = get_bool(body, "parallel_tool_calls", True)
    fields["temperature"] = body.get("temperature", 1.0)
    fields["top_p"] = body.get("top_p", 1.0)
    fields["top_logprobs"] = body.get("top_logprobs") or 0
    fields["truncation"] = "disabled"
    fields["service_tier"] = body.get("service_tier") or "default"
    fields["tools"] = body.get("tools") or []
    fields["tool_choice"] = body.get("tool_choice") or "auto"
    fields["text"] = text
    fields["reasoning"] = {"effort": None, "summary": None}
    fields["store"] = stored
    fields["previous_response_id"] = body.get("previous_response_id")
    fields["background"] = False
    if tools is None and fields["tools"]:
        fields["tool_choice"] = "none"
    return fields
