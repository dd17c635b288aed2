"""Who is calling: the API key a request presents, and the tenant (or admin) it belongs to.
Without a tenants file the server is open and every check passes."""

from __future__ import annotations

from tokstream.server.access.tenants import Tenant, Tenants


def presented_key(headers) -> str | None:
    """The key in x-api-key (Anthropic) or `Authorization: Bearer` (OpenAI), if any."""
    key = headers.get("x-api-key")
    if key:
        return key
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Auth:
    def __init__(self, tenants: Tenants | None):
        self.tenants = tenants

    def authenticate(self, headers) -> Tenant | None:
        """The calling tenant; None on an open server. Raises ApiError 401/403."""
        if self.tenants is None:
            return None
        return self.tenants.authenticate(presented_key(headers))

    def authenticate_admin(self, headers) -> None:
        if self.tenants is not None:
            self.tenants.authenticate_admin(presented_key(headers))

    def authenticate_metrics(self, headers) -> None:
        if self.tenants is not None:
            self.tenants.authenticate_metrics(presented_key(headers))
