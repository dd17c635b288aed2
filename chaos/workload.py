"""The recorded workload: streams sent over real HTTP, each one's full history kept (every SSE
event with its arrival time, the token ids and indices the integrity extension carries), and
progress that fault triggers wait on ("stream j has received k tokens")."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

import httpx

from tokstream.checker import OPT_IN, RecordedStream, SSEEvent, SSERecorder

SLOW_CLIENT_RCVBUF = 16384
"""Receive buffer of a client that stops reading: small, so the server's socket fills fast."""


@dataclass
class StreamSpec:
    name: str
    route: str
    body: dict
    role: str = "decode"
    """decode | long-prompt | probe: what the stream is there for."""
    hang_up_after: int | None = None
    """Close the connection once this many tokens have arrived (disconnect-storm)."""
    stop_reading_after: int | None = None
    """Stop reading once this many tokens have arrived, until released (slow-client)."""

    @property
    def max_tokens(self) -> int | None:
        """The most tokens the body asks for (`max_output_tokens` on the Responses API)."""
        return self.body.get("max_tokens", self.body.get("max_output_tokens"))

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature", 1.0) == 0

    @property
    def seeded(self) -> bool:
        return self.body.get("seed") is not None

    @property
    def sampling(self) -> str:
        return "greedy" if self.greedy else "seeded" if self.seeded else "sampled"


@dataclass
class StreamHistory:
    spec: StreamSpec
    started: float
    """Seconds since the experiment's clock started, when the request was sent."""
    status_code: int | None = None
    request_id: str | None = None
    events: list[tuple[float, SSEEvent]] = field(default_factory=list)
    tokens: list[tuple[float, int, int, int | None]] = field(default_factory=list)
    """(time, output index, token id, engine step id) for every token, in arrival order."""
    ended_at: float | None = None
    hung_up: bool = False
    stopped_reading: tuple[float, float] | None = None
    """(from, to) while the client read nothing."""
    transport_error: str | None = None
    body: str | None = None
    """A refused request's response body."""

    def recorded(self) -> RecordedStream:
        return RecordedStream([event for _, event in self.events])

    def times(self) -> list[float]:
        return [token[0] for token in self.tokens]


class Recorder:
    """Sends streams and records them; `await recorder.until(j, k)` waits for progress."""

    def __init__(self, url: str, headers: dict[str, str], clock: float, timeout_s: float):
        self.url = url
        # the integrity framing (id: lines) is what the checker reads; streams opt in
        self.headers = {**OPT_IN, **headers}
        self.clock = clock
        self.timeout_s = timeout_s
        self.histories: list[StreamHistory] = []
        self.tasks: list[asyncio.Task] = []
        self.released = asyncio.Event()
        """Set to let clients that stopped reading read again."""
        self._changed = asyncio.Event()
        self._client = httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                         limits=httpx.Limits(max_connections=None))
        self._slow_client = httpx.AsyncClient(
            base_url=url, timeout=timeout_s, limits=httpx.Limits(max_connections=None),
            transport=httpx.AsyncHTTPTransport(socket_options=[
                (socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_CLIENT_RCVBUF)]))

    def now(self) -> float:
        return time.monotonic() - self.clock

    async def close(self) -> None:
        await self._client.aclose()
        await self._slow_client.aclose()

    def start(self, spec: StreamSpec) -> asyncio.Task:
        history = StreamHistory(spec, self.now())
        self.histories.append(history)
        self.tasks.append(asyncio.ensure_future(self._run(history)))
        return self.tasks[-1]

    async def until(self, j: int, k: int, timeout_s: float) -> bool:
        """Stream j has received k tokens (or has ended: False then)."""
        deadline = time.monotonic() + timeout_s
        history = self.histories[j]
        while len(history.tokens) < k:
            if history.ended_at is not None or time.monotonic() > deadline:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        return True

    async def _run(self, history: StreamHistory) -> None:
        spec = history.spec
        client = self._slow_client if spec.stop_reading_after is not None else self._client
        recorder = SSERecorder()
        try:
            async with client.stream("POST", spec.route, json=spec.body,
                                     headers=self.headers) as response:
                history.status_code = response.status_code
                if response.status_code != 200:
                    history.body = (await response.aread()).decode("utf-8", "replace")[:500]
                    return
                async for chunk in response.aiter_raw():
                    for event in recorder.feed(chunk):
                        self._record(history, event)
                    if self._hang_up(history):
                        history.hung_up = True
                        return
                    if self._stop_reading(history):
                        stopped = self.now()
                        await self.released.wait()
                        history.stopped_reading = (stopped, self.now())
        except httpx.HTTPError as error:
            history.transport_error = f"{type(error).__name__}: {error}"
        finally:
            history.ended_at = self.now()
            self._changed.set()

    def _record(self, history: StreamHistory, event: SSEEvent) -> None:
        now = self.now()
        history.events.append((now, event))
        data = event.json_object()
        if data is None:
            return
        if history.request_id is None:
            message = data.get("message") or data.get("response")  # Anthropic, Responses API
            request_id = message.get("id") if isinstance(message, dict) else data.get("id")
            history.request_id = request_id if isinstance(request_id, str) else None
        ext = data.get("tokstream")
        if isinstance(ext, dict) and ext.get("token_ids"):
            steps = ext.get("step_ids") or [None] * len(ext["token_ids"])
            for token, index, step in zip(ext["token_ids"], ext.get("indices") or [], steps):
                history.tokens.append((now, index, token, step))
            self._changed.set()

    @staticmethod
    def _hang_up(history: StreamHistory) -> bool:
        limit = history.spec.hang_up_after
        return limit is not None and len(history.tokens) >= limit

    def _stop_reading(self, history: StreamHistory) -> bool:
        limit = history.spec.stop_reading_after
        return (limit is not None and history.stopped_reading is None
                and len(history.tokens) >= limit and not self.released.is_set())
