"""Where `top` gets its data: a server's /v1/state, /metrics and /v1/state/requests/{id}, over
HTTP only. Tests hand it an httpx transport that replays recorded responses."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from tokstream.state_snapshot import RequestDetail, StateSnapshot
from tokstream.top.printable import printable_reply

COUNTERS = {"vllm:generation_tokens_total": "output_tokens"}
"""Prometheus samples top reads (summed over labels) -> its own names."""


class SourceError(Exception):
    """The server could not be read (down, unreachable, refused the admin key, bad reply)."""


@dataclass
class Frame:
    """One poll: the /v1/state snapshot and the counters read from /metrics."""

    state: StateSnapshot
    counters: dict[str, float]


class HttpSource:
    def __init__(self, url: str, admin_key: str | None = None, timeout_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url = url.rstrip("/")
        headers = {"x-api-key": admin_key} if admin_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s,
                                         transport=transport)

    async def poll(self) -> Frame:
        replies = await asyncio.gather(self._get("/v1/state"), self._get("/metrics"),
                                       return_exceptions=True)
        # Both may fail alike (a missing admin key): name /v1/state's, whichever came first.
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        state, metrics = replies
        try:
            return Frame(StateSnapshot.from_wire(printable_reply(state.json())),
                         parse_counters(metrics.text))
        except (ValueError, TypeError, AttributeError) as error:
            raise SourceError(f"unreadable reply: {error}") from error

    async def request(self, request_id: str) -> RequestDetail | None:
        """One live request with its recent text; None once the server no longer has it."""
        response = await self._get(f"/v1/state/requests/{request_id}", missing_ok=True)
        if response.status_code == 404:
            return None
        try:
            return RequestDetail.from_wire(printable_reply(response.json()))
        except (ValueError, TypeError, AttributeError) as error:
            raise SourceError(f"unreadable reply: {error}") from error

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _get(self, path: str, missing_ok: bool = False) -> httpx.Response:
        try:
            response = await self._client.get(path)
        except httpx.HTTPError as error:
            raise SourceError(f"{type(error).__name__}: {error}" if str(error)
                              else type(error).__name__) from error
        if response.status_code == 404 and missing_ok:
            return response
        if response.status_code in (401, 403):
            raise SourceError(f"{path}: {response.status_code}, the admin key was "
                              f"{'rejected' if 'x-api-key' in self._client.headers else 'missing'}"
                              " (--admin-key)")
        if response.status_code != 200:
            raise SourceError(f"{path}: HTTP {response.status_code}")
        return response


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS samples of a Prometheus text exposition, each summed over its labels."""
    totals = {name: 0.0 for name in COUNTERS.values()}
    for line in text.splitlines():
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        name = COUNTERS.get(line[:name_end]) if name_end > 0 else None
        if name is None:
            continue
        # name{labels} value [timestamp]; label values may hold spaces and braces.
        tail = line[line.rfind("}") + 1:] if line[name_end] == "{" else line[name_end:]
        totals[name] += float(tail.split()[0])
    return totals
