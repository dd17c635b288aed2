"""A failed stream's error type comes from its kind, set where the failure was caught, not
from words in its message (server/streaming/sse.py); a failure without a kind is taken for the
server's (retry), never guessed from its words."""

from __future__ import annotations

import pytest

from tokstream.engine.messages.request import FinishReason, RequestDelta
from tokstream.errors import (ErrorKind, OverloadedError, PromptTooLongError, ReplicaError,
                              error_kind)
from tokstream.sampling_params import SamplingParams
from tokstream.server.streaming.sse import stream_failure
from tokstream.server.streaming.streams import StreamRegistry


class _Engine:
    def add_request(self, request, sink) -> None:
        pass


def _failed(message: str, kind: ErrorKind | None):
    registry = StreamRegistry(_Engine())
    stream = registry.open("r", [1, 2], SamplingParams(max_tokens=4), None, "anthropic")
    registry.deliver(RequestDelta("r", [], 0, "", finish_reason=FinishReason.ERROR,
                                   error=message, error_kind=kind))
    return stream_failure(stream)


@pytest.mark.parametrize("message, kind, expected", [
    # The kind decides, whatever the message says.
    ("the replica's engine is down", ErrorKind.USER, "api_error"),
    ("no room", ErrorKind.OVERLOADED, "overloaded_error"),
    ("lost its processes", ErrorKind.REPLICA, "overloaded_error"),
    ("grammar did not compile in time", ErrorKind.INVALID_REQUEST, "invalid_request_error"),
    # No kind: the server's fault, whatever the message says.
    ("replica down: rank 0 died", None, "overloaded_error"),
    ("bad grammar", None, "overloaded_error"),
])
def test_the_error_type_follows_the_kind(message, kind, expected):
    assert _failed(message, kind) == (expected, message)


def test_kinds_of_caught_errors_and_of_the_gateways_own_failures():
    assert error_kind(PromptTooLongError("x")) is ErrorKind.USER
    assert error_kind(OverloadedError("x")) is ErrorKind.OVERLOADED
    assert error_kind(ReplicaError("x")) is ErrorKind.REPLICA
    assert error_kind(KeyError("x")) is None
    registry = StreamRegistry(_Engine())
    stream = registry.open("r", [1], SamplingParams(max_tokens=4), None, "openai")
    assert registry.fail_live("gone") == 1
    assert stream.final.error_kind is ErrorKind.REPLICA
    assert stream.final.finish_reason == "error"  # the enum is its wire string
