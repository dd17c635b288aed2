"""The OpenAI Responses API: POST /v1/responses, streamed as its semantic events or answered
with one response object, and the stored responses' GET and DELETE /v1/responses/{id} and GET
/v1/responses/{id}/input_items. The body is read in responses_request.py, the answer written
in responses_output.py, and kept in conversation_store.py."""

from __future__ import annotations

import uuid

from starlette.responses import JSONResponse

from tokstream.server.api.api_request import read_request
from tokstream.server.api.responses_output import ResponseFormatter, response_body
from tokstream.server.api.conversation_store import owner_of
from tokstream.server.api.responses_request import parse, store_response, stored_response
from tokstream.server.api_errors import OPENAI, ApiError, api_route, bad_request
from tokstream.server.server import Server
from tokstream.server.streaming.responses import collect
from tokstream.server.streaming.sse import EventStreamResponse, stream_failure, wants_integrity
from tokstream.server.validation import get_int, parse_off_loop, shown

MAX_LIST = 100
"""Most input items one GET .../input_items returns (the API's limit)."""


@api_route(OPENAI)
async def create_response(request):
    server, tenant, body = await read_request(request)
    owner = owner_of(tenant)
    asked = await parse_off_loop(request, parse, body, server, server.conversations, owner)
    prompt = asked.prompt
    request_id = f"resp_{uuid.uuid4().hex[:24]}"
    stream = server.submit(request_id, prompt, tenant, OPENAI)
    headers = {"x-request-id": request_id}

    def keep(response: dict) -> None:
        if asked.fields["store"]:
            store_response(server.conversations, owner, response, asked)

    if prompt.stream:
        formatter = ResponseFormatter(stream, body["model"], asked.fields, server.tokenizer,
                                      asked.logprobs, wants_integrity(
                                          request.headers, server.config.stream_integrity),
                                      prompt.tools, on_done=keep)
        return EventStreamResponse(stream, formatter, server.registry,
                                   server.config.ping_interval_s, headers)
    batch = await collect(stream, request.receive, server.registry)
    failure = stream_failure(stream)
    if failure is not None:
        raise ApiError(*failure, retry_after=5 if failure[0] == "overloaded_error" else None)
    answer = response_body(stream, batch, body["model"], asked.fields, server.tokenizer,
                           asked.logprobs, prompt.tools)
    keep({key: value for key, value in answer.items() if key != "tokstream"})
    return JSONResponse(answer, headers=headers)


def stored(request) -> tuple[Server, str, dict]:
    """The stored response the path names, the caller's own (else a 404), with its input."""
    server: Server = request.app.state.server
    owner = owner_of(server.auth.authenticate(request.headers))
    response_id = request.path_params["response_id"]
    found = stored_response(server.conversations, owner, response_id)
    if found is None:
        raise ApiError("not_found_error", f"no stored response {shown(response_id)}")
    return server, owner, found


@api_route(OPENAI)
async def get_response(request):
    _, _, found = stored(request)
    return JSONResponse(found["response"])


@api_route(OPENAI)
async def delete_response(request):
    server, owner, found = stored(request)
    response_id = found["response"]["id"]
    server.conversations.delete(owner, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@api_route(OPENAI)
async def input_items(request):
    """The items the stored response answered, newest first unless order=asc, at most limit
    (1-100, default 20) after the item `after` names."""
    _, _, found = stored(request)
    query = dict(request.query_params)
    limit = _query_int(query, "limit", 20)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order", f"must be asc or desc, got {shown(order)}")
    items = found["input_items"] if order == "asc" else found["input_items"][::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request("after", f"no input item {shown(after)} in this response")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})


def _query_int(query: dict, name: str, default: int) -> int:
    if query.get(name) is None:
        return default
    try:
        value = int(query[name])
    except ValueError:
        raise bad_request(name, f"must be an integer, got {shown(query[name])}") from None
    return get_int({name: value}, name, minimum=1, maximum=MAX_LIST)
