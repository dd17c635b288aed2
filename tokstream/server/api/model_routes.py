"""GET /v1/models and GET /v1/models/{id}: the served model, in OpenAI's shape, or in
Anthropic's for a caller that sends `anthropic-version` (the anthropic SDK's
`models.list()` / `models.retrieve()`), since both APIs use these paths."""

from __future__ import annotations

import datetime

from starlette.responses import JSONResponse

from tokstream.server.api_errors import OPENAI, ApiError, api_route
from tokstream.server.server import Server
from tokstream.server.validation import shown


def describe(server: Server, anthropic: bool) -> dict:
    if anthropic:
        created = datetime.datetime.fromtimestamp(int(server.started), datetime.timezone.utc)
        return {"type": "model", "id": server.model_id, "display_name": server.model_id,
                "created_at": created.isoformat().replace("+00:00", "Z")}
    return {"id": server.model_id, "object": "model", "created": int(server.started),
            "owned_by": "tokstream", "max_model_len": server.max_model_len}


def caller(request) -> tuple[Server, bool]:
    """The server (the caller authenticated), and whether the caller speaks Anthropic's API."""
    server: Server = request.app.state.server
    server.auth.authenticate(request.headers)
    return server, "anthropic-version" in request.headers


@api_route(OPENAI)
async def models(request):
    server, anthropic = caller(request)
    model = describe(server, anthropic)
    if anthropic:
        return JSONResponse({"data": [model], "has_more": False, "first_id": model["id"],
                             "last_id": model["id"]})
    return JSONResponse({"object": "list", "data": [model]})


@api_route(OPENAI)
async def model(request):
    """The model by any name it is served under (--served-model-name's aliases too)."""
    server, anthropic = caller(request)
    name = request.path_params["model_id"]
    if name not in server.model_names:
        raise ApiError("not_found_error", f"model: {shown(name)} not found; this server serves "
                                          f"{server.model_id!r}", param="model")
    return JSONResponse(describe(server, anthropic))
