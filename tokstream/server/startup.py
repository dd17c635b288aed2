"""How `tokstream serve` starts, in the order that makes it short.

Most of a start is the engine core's: its ranks' forkserver imports torch (~1.7 of the ~3 s to
ready on dummy:tiny, on a 2-core Zen 3), and none of it needs the gateway. So once the
settings are checked and the socket is bound, the core is launched first, and this process
imports the gateway (~0.4 s) and loads the tokenizer (~0.3 s more for SmolLM2) meanwhile; the
app's lifespan then waits for the core to be ready (server/app.py).
"""

from __future__ import annotations

import contextlib
import socket

from tokstream.config import EngineConfig
from tokstream.errors import UserInputError
from tokstream.gateway_config import ServerConfig


def run(engine_config: EngineConfig, server_config: ServerConfig,
        log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM. Bad settings raise UserInputError before anything starts."""
    from tokstream.engine.async_engine import AsyncEngine
    from tokstream.engine.recovery.pool_files import PoolFiles
    from tokstream.model.source import resolve_model

    server_config.check_bind()
    if server_config.tenants_file:
        from tokstream.server.access.tenants import load_tenants
        load_tenants(server_config.tenants_file)  # fail fast on a bad file
    source = resolve_model(engine_config.model)
    with contextlib.ExitStack() as cleanup:  # undone last first, however serve ends
        sock = bind_socket(server_config.host, server_config.port,
                           server_config.send_buffer_bytes)
        cleanup.callback(sock.close)
        # The KV pool files outlive every engine core (engine/recovery/pool_files.py): the
        # gateway holds them, and each core it starts maps them.
        pool = PoolFiles(engine_config.tp)
        cleanup.callback(pool.close)
        engine = AsyncEngine(engine_config, pool)
        cleanup.callback(engine.discard)  # a core the gateway never came to serve with
        engine.launch()
        from tokstream.server.app import serve

        serve(engine, source, sock, server_config, log_level)


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
        raise UserInputError(f"cannot bind {host}:{port}: {error.strerror}") from None
    # Listen now: connections made as soon as the ready line appears wait in the backlog
    # until uvicorn starts accepting, instead of being refused.
    sock.listen(2048)
    return sock
