"""CORS: which web origins' pages may call the API from a browser (`--allowed-origins`).

None by default, so a page elsewhere can neither read answers nor pass a preflight. API keys
travel in headers, never cookies, so credentials are not allowed.
"""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

EXPOSED_HEADERS = ["request-id", "x-request-id", "retry-after", "x-should-retry"]


def cors_middleware(allowed_origins: list[str]) -> Middleware:
    return Middleware(CORSMiddleware, allow_origins=allowed_origins,
                      allow_methods=["GET", "POST"], allow_headers=["*"],
                      expose_headers=EXPOSED_HEADERS, allow_credentials=False, max_age=600)
