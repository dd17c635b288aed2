"""Server-sent events: framing, and the ASGI response that writes one stream to its caller.

The writer takes whatever the channel holds (merged if the caller lagged), formats it with the
API's formatter and sends it; a timer sends a keep-alive when nothing was sent for a ping
interval; a second task watches for the caller's disconnect and then cancels the writer, and
the registry aborts the request in the engine. A send that cannot complete within the
slow-client grace (the caller stopped reading) ends the response and closes the connection,
whatever the engine's state: nothing else would ever free a finished request's writer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Protocol

from tokstream.checker import INTEGRITY_HEADER
from tokstream.engine.messages.request import FinishReason
from tokstream.errors import ErrorKind
from tokstream.server.streaming.responses import until_first, wait_disconnect
from tokstream.server.streaming.streams import DeltaBatch, Stream, StreamRegistry

log = logging.getLogger("tokstream.server")


def wants_integrity(headers, server_default: bool) -> bool:
    """The request's INTEGRITY_HEADER if it sends one, else the server's setting."""
    value = headers.get(INTEGRITY_HEADER)
    return server_default if value is None else value.strip().lower() in ("1", "true", "yes")


def sse(event: str | None, data, event_id: str | int | None = None) -> bytes:
    """One SSE event; data is JSON-encoded unless already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"),
                                                            ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    if event_id is not None:
        head += f"id: {event_id}\n"
    return f"{head}data: {payload}\n\n".encode()


class StreamFormatter(Protocol):
    """Turns a stream's life into one API's SSE bytes."""

    def start(self) -> bytes: ...

    def tokens(self, batch: DeltaBatch) -> bytes: ...

    def finish(self, batch: DeltaBatch) -> bytes: ...

    def error(self, error_type: str, message: str) -> bytes: ...

    def ping(self) -> bytes: ...


def integrity(batch: DeltaBatch) -> dict:
    """The `tokstream` key of a token-carrying event: ids, indices, engine stamps."""
    ext = {"request_id": batch.request_ids[0], "token_ids": batch.token_ids,
           "indices": batch.indices, "step_ids": batch.step_ids}
    if any(r != batch.request_ids[0] for r in batch.request_ids):
        ext["request_ids"] = batch.request_ids
    return ext


ERROR_TYPES = {ErrorKind.USER: "api_error", ErrorKind.INVALID_REQUEST: "invalid_request_error"}
"""The API error type of a failed stream by who is at fault (any other: overloaded_error)."""


def stream_failure(stream: Stream) -> tuple[str, str] | None:
    """(error type, message) when a finished stream ended in failure, else None. A replica
    failure or an overload is overloaded_error (retry elsewhere or later); the request's own
    failure an api_error, or an invalid_request_error where its input was at fault."""
    final = stream.final
    if final.finish_reason == FinishReason.ERROR:
        message = final.error or "request failed"
        # Every producer sets the kind where it caught the failure; one without is the
        # server's fault, so the caller is told to retry.
        kind = final.error_kind or ErrorKind.REPLICA
        return ERROR_TYPES.get(kind, "overloaded_error"), message
    if final.finish_reason == FinishReason.ABORT:
        return "api_error", "request aborted by the server"
    return None


def final_integrity(stream: Stream) -> dict:
    final = stream.final
    return {"request_id": stream.request_id, "num_output_tokens": final.num_output_tokens,
            "digest": final.output_digest, "finish_reason": final.finish_reason}


class ClientStalled(Exception):
    """The caller read nothing for the slow-client grace."""


class EventStreamResponse:
    """ASGI response streaming one request as SSE."""

    def __init__(self, stream: Stream, formatter: StreamFormatter, registry: StreamRegistry,
                 ping_interval_s: float, headers: dict[str, str] | None = None):
        self.stream = stream
        self.formatter = formatter
        self.registry = registry
        self.ping_interval_s = ping_interval_s
        self.headers = headers or {}
        self._sent_since_ping = False

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                   (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        headers += [(k.encode(), v.encode()) for k, v in self.headers.items()]
        writer = asyncio.ensure_future(self._write(send, headers))
        listener = asyncio.ensure_future(wait_disconnect(receive))
        self.stream.writer = writer
        try:
            await until_first(writer, listener)
        finally:
            reason = "disconnected" if listener.done() and not listener.cancelled() \
                and listener.exception() is None and listener.result() else None
            stalled = writer.done() and not writer.cancelled() \
                and isinstance(writer.exception(), ClientStalled)
            self.registry.close(self.stream, "slow_client" if stalled else reason)
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            error = writer.exception()
            if not isinstance(error, (OSError, ClientStalled)):
                log.error("stream %s writer failed", self.stream.request_id, exc_info=error)

    async def _write(self, send, headers) -> None:
        send = self._bounded(send)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        channel = self.stream.channel
        loop = asyncio.get_running_loop()
        self._ping_timer = loop.call_later(self.ping_interval_s, self._ping_due)
        try:
            await self._send(send, self.formatter.start())
            while True:
                await channel.ready.wait()
                if self._ping_wanted:
                    self._ping_wanted = False
                    if not channel.pending.token_ids and not channel.pending.ended \
                            and not channel.pending.text:
                        channel.ready.clear()
                    await send({"type": "http.response.body", "body": self.formatter.ping(),
                                "more_body": True})
                    continue
                batch = channel.take()
                body = b""
                if batch.token_ids or batch.text:
                    body += self.formatter.tokens(batch)
                if batch.final is not None:
                    body += self.formatter.finish(batch)
                elif batch.error is not None:
                    body += self.formatter.error(*batch.error)
                if body:
                    await self._send(send, body)
                if batch.ended:
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self._ping_timer is not None:
                self._ping_timer.cancel()
                self._ping_timer = None

    _ping_wanted = False
    _ping_timer = None

    def _bounded(self, send):
        """send, failing with ClientStalled when one message waits past the grace."""
        grace = self.registry.slow_client_grace_s

        async def bounded_send(message) -> None:
            try:
                async with asyncio.timeout(grace):
                    await send(message)
            except TimeoutError:
                log.warning("%s: the client read nothing for %g s; connection closed",
                            self.stream.request_id, grace)
                raise ClientStalled(self.stream.request_id) from None

        return bounded_send

    async def _send(self, send, body: bytes) -> None:
        self._sent_since_ping = True
        await send({"type": "http.response.body", "body": body, "more_body": True})

    def _ping_due(self) -> None:
        """Every ping interval: ask for a keep-alive if nothing was sent during it."""
        if not self._sent_since_ping:
            self._ping_wanted = True
            self.stream.channel.ready.set()
        self._sent_since_ping = False
        if self._ping_timer is None:
            return  # the writer has finished
        self._ping_timer = asyncio.get_running_loop().call_later(self.ping_interval_s,
                                                                 self._ping_due)
