"""The Message Batches API: POST /v1/messages/batches (create), GET .../batches (list, newest
first), GET .../{id} (retrieve), POST .../{id}/cancel, DELETE .../{id} and GET
.../{id}/results (the .jsonl file), each batch seen only by the tenant that made it."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from tokstream.server.api.api_request import read_request
from tokstream.server.api.conversation_store import owner_of
from tokstream.server.api_errors import ANTHROPIC, ApiError, api_route, bad_request
from tokstream.server.batches.batch_runner import BatchRunner
from tokstream.server.batches.message_batch import MessageBatch, batch_items
from tokstream.server.server import Server
from tokstream.server.validation import shown

LIST_LIMIT = (1, 1000, 20)
"""A list page's least and most batches, and its default (the API's)."""


def runner(request) -> BatchRunner:
    return request.app.state.batches


def results_url(request, batch: MessageBatch) -> str:
    return str(request.url_for("message_batch_results", message_batch_id=batch.id))


def found(request) -> tuple[BatchRunner, MessageBatch]:
    """The batch the path names, the caller's own (else a 404)."""
    server: Server = request.app.state.server
    owner = owner_of(server.auth.authenticate(request.headers))
    batch_id = request.path_params["message_batch_id"]
    batch = runner(request).find(owner, batch_id)
    if batch is None:
        raise ApiError("not_found_error", f"no message batch {shown(batch_id)}")
    return runner(request), batch


def ended(request, what: str) -> tuple[BatchRunner, MessageBatch]:
    """found(request), once the batch has ended (else a 400 saying what waits for that)."""
    batches, batch = found(request)
    if batch.ended_at is None:
        raise ApiError("invalid_request_error", f"message batch {batch.id} is still "
                       f"{batch.processing_status}: {what} once it has ended")
    return batches, batch


def answer(request, batch: MessageBatch) -> JSONResponse:
    return JSONResponse(batch.body(results_url(request, batch)))


@api_route(ANTHROPIC)
async def create_batch(request):
    server, tenant, body = await read_request(request)
    if server.config.batch_concurrency == 0 or not server.conversations.enabled:
        raise ApiError("invalid_request_error", "this server runs no message batches "
                       "(--batch-concurrency 0 or --conversation-store-bytes 0)")
    server.check_ready()
    batch = await runner(request).start(owner_of(tenant), tenant, batch_items(body))
    return answer(request, batch)


@api_route(ANTHROPIC)
async def list_batches(request):
    server: Server = request.app.state.server
    owner = owner_of(server.auth.authenticate(request.headers))
    query = request.query_params
    low, high, default = LIST_LIMIT
    try:
        limit = int(query.get("limit", default))
    except ValueError:
        raise bad_request("limit", f"must be an integer, got {shown(query['limit'])}") from None
    if not low <= limit <= high:
        raise bad_request("limit", f"must be in [{low}, {high}], got {limit}")
    batches = runner(request).owned(owner)
    ids = [batch.id for batch in batches]
    for cursor in ("after_id", "before_id"):
        if cursor in query and query[cursor] not in ids:
            raise bad_request(cursor, f"no message batch {shown(query[cursor])}")
    if "before_id" in query:  # the page just before (newer than) it
        end = ids.index(query["before_id"])
        page = batches[max(0, end - limit):end]
        has_more = end - limit > 0
    else:
        start = ids.index(query["after_id"]) + 1 if "after_id" in query else 0
        page = batches[start:start + limit]
        has_more = start + limit < len(batches)
    return JSONResponse({"data": [batch.body(results_url(request, batch)) for batch in page],
                         "has_more": has_more,
                         "first_id": page[0].id if page else None,
                         "last_id": page[-1].id if page else None})


@api_route(ANTHROPIC)
async def retrieve_batch(request):
    return answer(request, found(request)[1])


@api_route(ANTHROPIC)
async def cancel_batch(request):
    batches, batch = found(request)
    batches.cancel(batch)
    return answer(request, batch)


@api_route(ANTHROPIC)
async def delete_batch(request):
    batches, batch = ended(request, "cancel it, and delete it")
    batches.delete(batch)
    return JSONResponse({"id": batch.id, "type": "message_batch_deleted"})


@api_route(ANTHROPIC)
async def batch_results(request):
    _, batch = ended(request, "its results come")
    return Response(batch.results_jsonl(), media_type="application/binary")
