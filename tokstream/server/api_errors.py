"""Typed HTTP errors, rendered in the shape of the API that was called.

One error type list (Anthropic's names) maps to both wire formats:
Anthropic `{"type":"error","error":{"type","message"}}`, OpenAI `{"error":{"message","type",
"param","code"}}`. Overload is 529 on Anthropic routes and 503 on OpenAI routes, always with
`retry-after`.
"""

from __future__ import annotations

import functools
import json
import logging

from starlette.responses import Response

from tokstream.errors import OverloadedError, ReplicaError, UserInputError

ANTHROPIC = "anthropic"
OPENAI = "openai"

STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "method_not_allowed": 405,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


class ApiError(Exception):
    """One request failed: a 4xx (or an overload refusal) with a message naming the cause."""

    def __init__(self, error_type: str, message: str, param: str | None = None,
                 retry_after: float | None = None, status: int | None = None,
                 details: dict | None = None):
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.param = param
        """The offending field (OpenAI's `param`), when one is to blame."""
        self.details = details
        """Anthropic's `error.details` (an `error_code` a client acts on), when there is one."""
        self.retry_after = retry_after
        self.status = status or STATUS[error_type]

    def status_for(self, api: str) -> int:
        if self.error_type == "overloaded_error" and api == OPENAI:
            return 503
        return self.status


class ClientGone(Exception):
    """The caller left before its response was ready: nothing is sent (logged as 499)."""


def bad_request(param: str, message: str) -> ApiError:
    """400 whose message starts with the field's path, e.g. `messages.0.role: ...`."""
    return ApiError("invalid_request_error", f"{param}: {message}", param=param)


def error_body(api: str, error_type: str, message: str, param: str | None = None,
               details: dict | None = None) -> dict:
    if api == ANTHROPIC:
        error = {"type": error_type, "message": message}
        return {"type": "error", "error": {**error, "details": details} if details else error}
    return {"error": {"message": message, "type": error_type, "param": param,
                      "code": STATUS.get(error_type)}}


def error_response(api: str, error: ApiError) -> Response:
    headers = {}
    if error.retry_after is not None:
        headers["retry-after"] = str(max(1, int(-(-error.retry_after // 1))))
    if error.error_type == "overloaded_error" and api == ANTHROPIC:
        headers["x-should-retry"] = "true"
    if error.status == 408:
        headers["connection"] = "close"  # the rest of the body may still come: not reusable
    body = json.dumps(error_body(api, error.error_type, error.message, error.param,
                                 error.details))
    return Response(body, status_code=error.status_for(api), headers=headers,
                    media_type="application/json")


def api_for_path(path: str) -> str:
    """Which wire format an error on this path speaks (for routing-level errors too)."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def api_route(api: str):
    """Wrap an endpoint: ApiError and bad input become typed responses in the API's shape;
    anything unexpected is logged and becomes a 500 api_error (never a bare traceback)."""
    def wrap(endpoint):
        @functools.wraps(endpoint)
        async def wrapper(request):
            try:
                return await endpoint(request)
            except ApiError as error:
                failure = error
            except ClientGone:
                return Response(status_code=499)  # nobody is listening any more
            except UserInputError as error:
                failure = ApiError("invalid_request_error", str(error))
            except OverloadedError as error:
                failure = ApiError("overloaded_error", str(error), retry_after=1)
            except ReplicaError as error:
                failure = ApiError("overloaded_error", f"replica unavailable: {error}",
                                   retry_after=5)
            except Exception:
                logging.getLogger("tokstream.server").exception("unhandled error on %s",
                                                                request.url.path)
                failure = ApiError("api_error", "internal server error")
            server = getattr(request.app.state, "server", None)
            if server is not None:
                server.metrics.errors.labels(failure.error_type).inc()
            return error_response(api, failure)

        return wrapper

    return wrap
