"""The gateway: a Starlette app in front of the engine core, served by uvicorn.

    tokstream serve --model dummy:tiny --port 0

The engine core (and its workers) is launched before the gateway is built (server/startup.py)
and waited for in the app's lifespan; the event loop only routes, validates, tokenises and
streams. A ready line goes to stderr once the engine is up:
`tokstream serve: ready on http://HOST:PORT ...` (tests read the port from it).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokstream import gc_policy
from tokstream.engine.async_engine import AsyncEngine
from tokstream.gateway_config import ServerConfig
from tokstream.model.source import ModelSource
from tokstream.server.api import (anthropic_routes, model_routes, openai_routes,
                                  responses_routes, tokenizer_routes)
from tokstream.server.batches import batch_routes
from tokstream.server.batches.batch_runner import BatchRunner
from tokstream.server.operations import admin_routes
from tokstream.server.access.connection_limits import (ConnectionLimits, connection_cap,
                                                       guarded_protocol, raise_descriptor_limit)
from tokstream.server.access.cors import cors_middleware
from tokstream.server.access.host_check import HostCheck
from tokstream.server.replica.kept_pool import hand_over
from tokstream.server.api_errors import ApiError, api_for_path, error_response
from tokstream.server.operations.openapi import openapi_schema
from tokstream.server.operations import health
from tokstream.server.replica.drain import DrainingServer
from tokstream.server.server import Server
from tokstream.server.validation import shown

log = logging.getLogger("tokstream.server")


def routes() -> list[Route]:
    return [
        Route("/v1/messages", anthropic_routes.create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_routes.count_tokens, methods=["POST"]),
        Route("/v1/messages/batches", batch_routes.create_batch, methods=["POST"]),
        Route("/v1/messages/batches", batch_routes.list_batches, methods=["GET"]),
        Route("/v1/messages/batches/{message_batch_id}", batch_routes.retrieve_batch,
              methods=["GET"]),
        Route("/v1/messages/batches/{message_batch_id}", batch_routes.delete_batch,
              methods=["DELETE"]),
        Route("/v1/messages/batches/{message_batch_id}/cancel", batch_routes.cancel_batch,
              methods=["POST"]),
        Route("/v1/messages/batches/{message_batch_id}/results", batch_routes.batch_results,
              methods=["GET"], name="message_batch_results"),
        Route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_routes.completions, methods=["POST"]),
        Route("/v1/responses", responses_routes.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_routes.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_routes.delete_response,
              methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses_routes.input_items,
              methods=["GET"]),
        Route("/v1/models", model_routes.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_routes.model, methods=["GET"]),
        Route("/tokenize", tokenizer_routes.tokenize, methods=["POST"]),
        Route("/detokenize", tokenizer_routes.detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_routes.tokenizer_info, methods=["GET"]),
        Route("/health", admin_routes.health, methods=["GET"]),
        Route("/health/live", health.live, methods=["GET"]),
        Route("/health/ready", health.ready, methods=["GET"]),
        Route("/metrics", admin_routes.metrics, methods=["GET"]),
        Route("/v1/state", admin_routes.state, methods=["GET"]),
        Route("/v1/state/requests/{request_id}", admin_routes.request_state, methods=["GET"]),
        Route("/v1/score", admin_routes.score, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


async def openapi(request):
    return JSONResponse(openapi_schema())


async def http_error(request, exc: HTTPException):
    """Routing errors (unknown path, wrong method) in the API's error shape."""
    kinds = {404: "not_found_error", 405: "method_not_allowed", 413: "request_too_large"}
    error = ApiError(kinds.get(exc.status_code, "invalid_request_error"),
                     f"{request.method} {shown(request.url.path)}: {exc.detail}",
                     status=exc.status_code)
    return error_response(api_for_path(request.url.path), error)


def build_app(engine: AsyncEngine, server_config: ServerConfig, model_id: str,
              aliases: set[str], tokenizer, url: str | None = None) -> Starlette:
    """The app over engine, a core launched (AsyncEngine.launch) that its lifespan waits for."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.start()
        server = batches = None
        try:
            await hand_over(engine)
            server = app.state.server = Server(server_config, engine, tokenizer, model_id,
                                               aliases)
            batches = app.state.batches = BatchRunner(server)
            gc_policy.settle_after_start()  # before the first request's stream
            if url is not None:
                print(f"tokstream serve: ready on {url} (model {model_id}, "
                      f"{engine.info.get('dtype')}, {engine.info.get('weights')} weights, "
                      f"{engine.info.get('num_blocks')} KV blocks; "
                      f"gateway pid {__import__('os').getpid()}, engine pid {engine.pid})",
                      file=sys.stderr, flush=True)
            yield
        finally:
            if batches is not None:
                await batches.close()
            # The server's engine may be a later one than this (after an engine core restart).
            await (server.close() if server is not None else engine.shutdown())

    # Outermost first: a foreign Host is refused before anything else looks at the request.
    middleware = [Middleware(HostCheck, allowed_hosts=server_config.allowed_hosts),
                  cors_middleware(server_config.allowed_origins)]
    app = Starlette(routes=routes(), lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error})
    return app


def serve(engine: AsyncEngine, source: ModelSource, sock: socket.socket,
          server_config: ServerConfig, log_level: str = "warning") -> None:
    """Build the gateway over a launched engine core and serve on sock (bound and listening)
    until SIGINT/SIGTERM."""
    import uvicorn

    from tokstream.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source)
    model_id = server_config.served_model_name or engine.config.model
    aliases = {engine.config.model, source.config.name}
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    app = build_app(engine, server_config, model_id, aliases, tokenizer,
                    url=f"http://{shown}:{port}")
    limits = ConnectionLimits(
        connection_cap(server_config.max_connections, server_config.descriptor_reserve,
                       raise_descriptor_limit()), server_config.header_timeout_s)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3, timeout_keep_alive=30,
                            http=guarded_protocol(limits))
    server = DrainingServer(config, server_config.shutdown_timeout_s)
    server.run(sockets=[sock])
    if not server.started:
        from tokstream.errors import ReplicaError
        raise ReplicaError("server failed to start (see the log above)")
