"""Streams under a fault, for tests that break a live server on purpose: a workload's streams
run at once while a fault coroutine waits on logical points (stream j has k tokens, /v1/state
shows a prefill running; never a sleep), each stream recorded and passed through the stream
checker; then the processes the fault touched are checked to be gone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import psutil

from tokstream.checker import RecordedStream, SSERecorder, check_streams


class Progress:
    """Tokens (with their arrival times) each stream of a run has received, to wait on."""

    def __init__(self, n: int):
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.request_ids: list[str | None] = [None] * n
        self._changed = asyncio.Event()

    def add(self, j: int, num_tokens: int) -> None:
        self.times[j] += [time.time()] * num_tokens
        self._changed.set()

    async def until(self, j: int, k: int) -> None:
        while len(self.times[j]) < k:
            self._changed.clear()
            await self._changed.wait()


async def record_stream(client, j, route, body, progress) -> RecordedStream:
    """POST body to route and record the stream; progress counts stream j's tokens as they come."""
    recorder = SSERecorder()
    async with client.stream("POST", route, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for chunk in response.aiter_bytes():
            for event in recorder.feed(chunk):
                try:
                    data = event.json()
                except ValueError:
                    continue
                if progress.request_ids[j] is None:
                    progress.request_ids[j] = (data.get("message") or data.get("response")
                                               or data).get("id")
                ext = data.get("tokstream") if isinstance(data, dict) else None
                if ext and ext.get("token_ids"):
                    progress.add(j, len(ext["token_ids"]))
    return recorder.stream()


def run_streams(server, workload, fault=None):
    """Run the workload's streams ((route, body) pairs) at once; fault(client, progress) runs
    alongside them. Every stream must complete with body["max_tokens"] tokens and pass the
    stream checker. Returns (checked stream reports, progress)."""
    async def main():
        progress = Progress(len(workload))
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            streams = [asyncio.ensure_future(record_stream(client, j, route, body, progress))
                       for j, (route, body) in enumerate(workload)]
            if fault is not None:
                await fault(client, progress)
            return await asyncio.gather(*streams), progress

    streams, progress = asyncio.run(main())
    report = check_streams(streams)
    assert report.ok, report.summary()
    assert report.statuses == {"complete": len(workload), "failed": 0, "cut": 0}
    for stream, (_, body) in zip(report.streams, workload):
        wanted = body.get("max_tokens", body.get("max_output_tokens"))  # the Responses API's
        assert len(stream.token_ids) == wanted, stream.request_id
    return report, progress


async def state(client) -> dict:
    response = await client.get("/v1/state")
    response.raise_for_status()
    return response.json()


async def state_until(client, predicate, timeout=60) -> dict:
    """The first /v1/state snapshot that satisfies predicate (polled, not waited out)."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = await state(client)
        if predicate(snapshot):
            return snapshot
        assert time.monotonic() < deadline, json.dumps(snapshot)[:2000]
        await asyncio.sleep(0.02)  # leave the CPU to a restarting engine between polls


def kill(pid: int, sig=signal.SIGKILL) -> None:
    os.kill(pid, sig)


def tree(pid: int) -> list[int]:
    """pid and every process under it (an engine core: its ranks and its spare's)."""
    process = psutil.Process(pid)
    return [pid, *(child.pid for child in process.children(recursive=True))]


def gone(pids, timeout=30) -> bool:
    """Every pid exits (no orphans) within timeout; a zombie awaiting its reaper counts."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            return False
    return True
