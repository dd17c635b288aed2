"""Refuse requests addressed to a Host name that is not this server's (DNS rebinding).

A web page on evil.example can point its own name at 127.0.0.1 and then read this server's
answers as same-origin; its requests still carry `Host: evil.example`. Loopback names and IP
literals are always accepted (a rebinding page cannot send those), plus `--allowed-hosts`
(`api.example.com`, `.example.com` for it and its subdomains, `*` for any).
"""

from __future__ import annotations

import ipaddress

from tokstream.server.api_errors import ApiError, api_for_path, error_response
from tokstream.server.validation import shown


def host_name(header: str) -> str:
    """The name part of a Host header: no port, no IPv6 brackets, lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name, sep, port = header.rpartition(":")
    if sep and port.isdigit():
        header = name
    return header.rstrip(".")


def host_allowed(header: str | None, allowed: list[str]) -> bool:
    if header is None or "*" in allowed:
        return True  # no Host at all: not a browser (HTTP/1.0 tools)
    name = host_name(header)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return any(name == entry or (entry.startswith(".") and
                                 (name.endswith(entry) or name == entry[1:]))
               for entry in allowed)


class HostCheck:
    """ASGI middleware: 403 in the API's error shape for a Host name not allowed."""

    def __init__(self, app, allowed_hosts: list[str]):
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            header = next((value.decode("latin-1") for key, value in scope["headers"]
                           if key == b"host"), None)
            if not host_allowed(header, self.allowed_hosts):
                error = ApiError("permission_error",
                                 f"Host {shown(header)} is not a name of this server (add it "
                                 "with --allowed-hosts)", param="host")
                await error_response(api_for_path(scope["path"]), error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
