"""What every API route reads first, the same on both APIs: who is calling (authenticated
before anything else is read), the JSON body within the server's limits, and the body's chat
messages each checked to be an object with a known role."""

from __future__ import annotations

from typing import Iterator

from tokstream.server.api_errors import bad_request
from tokstream.server.server import Server
from tokstream.server.access.tenants import Tenant
from tokstream.server.validation import _kind, read_json, shown


async def read_request(request) -> tuple[Server, Tenant | None, dict]:
    """The server, the calling tenant (None on an open server) and the request's JSON body."""
    server: Server = request.app.state.server
    tenant = server.auth.authenticate(request.headers)
    body = await read_json(request, server.config.max_body_bytes, server.config.body_timeout_s)
    return server, tenant, body


def chat_turns(messages: list, roles: tuple[str, ...],
               roles_named: str) -> Iterator[tuple[str, dict, str]]:
    """(path, message, role) for each message, in order; a 400 naming the first that is not
    an object or whose role is not one of roles (roles_named says them in the error)."""
    for n, message in enumerate(messages):
        at = f"messages.{n}"
        if not isinstance(message, dict):
            raise bad_request(at, f"must be an object, not {_kind(message)}")
        role = message.get("role")
        if role not in roles:
            raise bad_request(f"{at}.role", f"must be {roles_named}, got {shown(role)}")
        yield at, message, role
