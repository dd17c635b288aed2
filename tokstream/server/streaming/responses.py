"""Non-streaming responses: wait for a request's end while watching for the caller leaving."""

from __future__ import annotations

import asyncio

from tokstream.server.api_errors import ApiError, ClientGone
from tokstream.server.streaming.streams import DeltaBatch, Stream, StreamRegistry


async def wait_disconnect(receive) -> bool:
    """Until the caller disconnects (then True); any other message is passed over."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return True


async def until_first(*tasks: asyncio.Future) -> None:
    """Wait for the first of tasks to end, then cancel the others and let them all wind down;
    each task keeps its outcome (result, exception or cancelled) for the caller to read."""
    try:
        await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _drain(stream: Stream) -> DeltaBatch:
    total = DeltaBatch()
    channel = stream.channel
    while True:
        await channel.ready.wait()
        batch = channel.take()
        total.merge(batch)
        if batch.final is not None:
            total.final = batch.final
            return total
        if batch.error is not None:
            raise ApiError(batch.error[0], batch.error[1])


async def collect(stream: Stream, receive, registry: StreamRegistry) -> DeltaBatch:
    """Every token and the final delta of stream; aborts the request if the caller leaves."""
    drain = asyncio.ensure_future(_drain(stream))
    listener = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await until_first(drain, listener)
    finally:
        registry.close(stream, "disconnected" if drain.cancelled() else None)
    if drain.cancelled():
        raise ClientGone(stream.request_id)
    return drain.result()
