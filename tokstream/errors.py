"""Typed errors. The name says who is at fault and what survives.

- `UserInputError` and its children: one request (or one CLI call) is wrong; nothing else is
  harmed. The CLI prints the message on one line and exits 2; the server answers 4xx.
- `ReplicaError`: the serving replica itself is unusable; every open stream gets an error.

`ErrorKind` names the same for a failure that crosses a process boundary as data (a
request's final delta): set where the exception is caught, read by whoever answers the caller.
"""

from tokstream.wire import WireEnum


class ErrorKind(WireEnum):
    """Who is at fault when a request ends in an error."""

    USER = "user"
    """This request alone (its input, or it kept breaking the model's processes): api_error."""
    INVALID_REQUEST = "invalid_request"
    """This request alone, for its input, found unusable only once the engine ran it (a
    grammar that did not compile in time): invalid_request_error."""
    OVERLOADED = "overloaded"
    """No room for it now (or the server is shutting down): retry later or elsewhere."""
    REPLICA = "replica"
    """The replica is unusable: retry on another one or later."""


class TokstreamError(Exception):
    """Base of every error tokstream raises on purpose."""


class UserInputError(TokstreamError, ValueError):
    """Bad input from a user: a flag, a prompt, a sampling parameter, a model name."""


class ModelNotFoundError(UserInputError):
    """The model name or path does not resolve to anything loadable."""


class CorruptModelError(UserInputError):
    """The model file exists but cannot be read (truncated, wrong format, missing tensors)."""


class PromptTooLongError(UserInputError):
    """The prompt (plus at least one output token) does not fit in the model's context."""


class OverloadedError(TokstreamError):
    """The replica is healthy but has no room for this now (KV pool, queue); retry later."""


class ReplicaError(TokstreamError, RuntimeError):
    """The engine or one of its ranks failed; the replica cannot serve until it recovers."""


def error_kind(error: Exception) -> ErrorKind | None:
    """The kind of a caught tokstream error (None for anything else)."""
    if isinstance(error, UserInputError):
        return ErrorKind.USER
    if isinstance(error, OverloadedError):
        return ErrorKind.OVERLOADED
    if isinstance(error, ReplicaError):
        return ErrorKind.REPLICA
    return None
