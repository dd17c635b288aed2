"""The gateway: a Starlette app in front of the engine core, served by uvicorn.

    tokstream serve --model dummy:tiny --port 0

The engine core (and its workers) start in the app's lifespan; the event loop only routes,
validates, tokenises and streams. A ready line goes to stderr once the engine is up:
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
from tokstream.config import EngineConfig
from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.recovery.pool_files import PoolFiles
from tokstream.gateway_config import ServerConfig
from tokstream.server.api import anthropic_routes, openai_routes, tokenizer_routes
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
        Route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_routes.completions, methods=["POST"]),
        Route("/v1/models", openai_routes.models, methods=["GET"]),
        Route("/tokenize", tokenizer_routes.tokenize, methods=["POST"]),
        Route("/detokenize", tokenizer_routes.detokenize, methods=["POST"]),
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


def build_app(engine_config: EngineConfig, server_config: ServerConfig, model_id: str,
              aliases: set[str], tokenizer, url: str | None = None) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        # The KV pool files outlive every engine core (engine/recovery/pool_files.py): the
        # gateway holds them, and each core it starts maps them.
        pool = PoolFiles(engine_config.tp)
        try:
            engine = await AsyncEngine(engine_config, pool).start()
        except BaseException:
            pool.close()
            raise
        server = None
        try:
            await hand_over(engine)
            server = app.state.server = Server(server_config, engine, tokenizer, model_id,
                                               aliases)
            gc_policy.settle_after_start()  # before the first request's stream
            if url is not None:
                print(f"tokstream serve: ready on {url} (model {model_id}, "
                      f"{engine.info.get('dtype')}, {engine.info.get('weights')} weights, "
                      f"{engine.info.get('num_blocks')} KV blocks; "
                      f"gateway pid {__import__('os').getpid()}, engine pid {engine.pid})",
                      file=sys.stderr, flush=True)
            yield
        finally:
            # The server's engine may be a later one than this (after an engine core restart).
            await (server.close() if server is not None else engine.shutdown())
            pool.close()

    # Outermost first: a foreign Host is refused before anything else looks at the request.
    middleware = [Middleware(HostCheck, allowed_hosts=server_config.allowed_hosts),
                  cors_middleware(server_config.allowed_origins)]
    app = Starlette(routes=routes(), lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error})
    return app


def bind_socket(host: str, port: int, send_buffer_bytes: int | None = None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes:
        # Accepted connections inherit it from the listening socket.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        from tokstream.errors import UserInputError
        raise UserInputError(f"cannot bind {host}:{port}: {error.strerror}") from None
    # Listen now: connections made as soon as the ready line appears wait in the backlog
    # until uvicorn starts accepting, instead of being refused.
    sock.listen(2048)
    return sock


def run(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "warning"):
    """Serve until SIGINT/SIGTERM. Bad settings raise UserInputError before anything starts."""
    import uvicorn

    from tokstream.model.source import resolve_model
    from tokstream.text.tokenizer import load_tokenizer

    server_config.check_bind()
    if server_config.tenants_file:
        from tokstream.server.access.tenants import load_tenants
        load_tenants(server_config.tenants_file)  # fail fast on a bad file
    source = resolve_model(engine_config.model)
    tokenizer = load_tokenizer(source)
    model_id = server_config.served_model_name or engine_config.model
    aliases = {engine_config.model, source.config.name}
    sock = bind_socket(server_config.host, server_config.port, server_config.send_buffer_bytes)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    app = build_app(engine_config, server_config, model_id, aliases, tokenizer,
                    url=f"http://{shown}:{port}")
    limits = ConnectionLimits(
        connection_cap(server_config.max_connections, server_config.descriptor_reserve,
                       raise_descriptor_limit()), server_config.header_timeout_s)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3, timeout_keep_alive=30,
                            http=guarded_protocol(limits))
    server = DrainingServer(config, server_config.shutdown_timeout_s)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        from tokstream.errors import ReplicaError
        raise ReplicaError("server failed to start (see the log above)")
