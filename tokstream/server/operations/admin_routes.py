"""Operational routes: /health, /metrics, and the admin routes /v1/state, /v1/state/requests/{id},
/v1/score (these need the admin key when a tenants file is configured)."""

from __future__ import annotations

import time

from starlette.responses import JSONResponse, Response

from tokstream.core_state import CoreSnapshot
from tokstream.server.api.anthropic_routes import chat_messages, encode_messages
from tokstream.server.access.auth import presented_key
from tokstream.server.api_errors import OPENAI, ApiError, api_route, bad_request
from tokstream.server.operations.metrics import SCRAPE_WAIT_S
from tokstream.server.server import Server
from tokstream.server.validation import _kind, get_int, parse_off_loop, read_json, shown
from tokstream.state_snapshot import ReplicaStatus, RequestDetail, RequestParams

MAX_SCORE_TOKENS = 65536


async def health(request):
    server: Server = request.app.state.server
    ready = server.status == ReplicaStatus.READY
    return JSONResponse({"status": server.status}, status_code=200 if ready else 503,
                        headers=None if ready else {"retry-after": "5"})


@api_route(OPENAI)
async def metrics(request):
    server: Server = request.app.state.server
    tenants = True
    try:
        server.auth.authenticate_metrics(request.headers)
    except ApiError:
        if not (server.config.public_load_metrics and not presented_key(request.headers)):
            raise
        tenants = False  # the load series a router reads, nothing that names a tenant
    # A busy core is not waited for: the endpoint picker polls every 50 ms and gives up on a
    # scrape after 1 s; past SCRAPE_WAIT_S the last snapshot is served.
    await server.core_snapshot(patience_s=SCRAPE_WAIT_S)
    server.metrics.live.set(len(server.registry))
    server.metrics.stored.set(server.conversations.count())
    server.metrics.stored_bytes.set(server.conversations.bytes)
    batches = getattr(request.app.state, "batches", None)  # the app's lifespan makes it
    running = list(batches.running.values()) if batches is not None else []
    server.metrics.batches.set(len(running))
    counts = [batch.request_counts() for batch in running]
    for name in ("processing", "succeeded", "errored", "canceled", "expired"):
        server.metrics.batch_requests.labels(name).set(sum(c[name] for c in counts))
    return Response(server.metrics.render(tenants=tenants),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@api_route(OPENAI)
async def state(request):
    server: Server = request.app.state.server
    server.auth.authenticate_admin(request.headers)
    started = time.perf_counter()
    snapshot = await server.snapshot()
    snapshot.build_ms = (time.perf_counter() - started) * 1000
    return JSONResponse(snapshot.to_wire())


@api_route(OPENAI)
async def request_state(request):
    server: Server = request.app.state.server
    server.auth.authenticate_admin(request.headers)
    request_id = request.path_params["request_id"]
    stream = server.registry.streams.get(request_id)
    if stream is None:
        raise ApiError("not_found_error", f"request_id: no live request {shown(request_id)}",
                       param="request_id")
    core = CoreSnapshot.from_wire(await server.core_snapshot() or {})
    engine_row = next((r for r in core.requests if r.id == request_id), None)
    params = stream.params
    detail = RequestDetail(
        **vars(stream.row(time.monotonic())), engine=engine_row,
        state=engine_row.state if engine_row else "finishing" if stream.final else "submitted",
        params=RequestParams(params.max_tokens, params.temperature, params.top_p, params.top_k,
                             params.seed, params.stop),
        delivered_token_ids=stream.delivered[-64:],
        recent_text=server.registry.recent_text(stream))
    return JSONResponse(detail.to_wire())


def _token_ids(body: dict, name: str, required: bool) -> list[int] | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(name, "required")
        return None
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                          for t in value):
        raise bad_request(name, f"must be an array of integer token ids, not {_kind(value)}")
    if len(value) > MAX_SCORE_TOKENS:
        raise bad_request(name, f"at most {MAX_SCORE_TOKENS} tokens")
    return value


@api_route(OPENAI)
async def score(request):
    """Body: {"token_ids": [...], "start": 1} scores positions start..n-1; or
    {"prompt_token_ids": [...], "output_token_ids": [...]} scores the outputs; or
    {"messages": [...], "system"?: ..., "output_token_ids": [...]} (the prompt as
    /v1/messages builds it)."""
    server: Server = request.app.state.server
    server.auth.authenticate_admin(request.headers)
    body = await read_json(request, server.config.max_body_bytes,
                           server.config.body_timeout_s)
    if body.get("model") is not None:
        server.check_model(body["model"])
    server.check_ready()
    outputs = _token_ids(body, "output_token_ids", False)
    if outputs is not None and "messages" in body:
        # The prompt exactly as POST /v1/messages builds it (chat template, system), so a
        # caller holding only its request and the streamed token ids can re-score them.
        prompt = await parse_off_loop(request, lambda: encode_messages(server,
                                                                       chat_messages(body)))
        if not outputs:
            raise bad_request("output_token_ids", "must not be empty")
        token_ids, start = prompt + outputs, len(prompt)
    elif outputs is not None:
        prompt = _token_ids(body, "prompt_token_ids", True)
        if not prompt:
            raise bad_request("prompt_token_ids", "must not be empty")
        if not outputs:
            raise bad_request("output_token_ids", "must not be empty")
        token_ids, start = prompt + outputs, len(prompt)
    else:
        token_ids = _token_ids(body, "token_ids", True)
        start = get_int(body, "start", 1, minimum=1)
    result = await server.engine.score(token_ids, start)
    positions = []
    for offset, (logit, top, top_id) in enumerate(zip(result.token_logits, result.top_logits,
                                                      result.top_token_ids)):
        position = start + offset
        positions.append({"position": position, "token_id": token_ids[position],
                          "logit": logit, "top_logit": top, "top_token_id": top_id})
    return JSONResponse({"model": server.model_id, "start": start,
                         "num_tokens": len(token_ids), "positions": positions,
                         "execute_ms": result.execute_s * 1000})
