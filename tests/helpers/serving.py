"""Helpers for tests that run a real `tokstream serve` process on a free port: the server
harness is tokstream.serve_process (the same one chaos and the benchmarks use), with what tests
add (the integrity framing, the engine's self-check, /v1/state polling)."""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest

from tokstream.checker import OPT_IN, RecordedStream, SSERecorder
from tokstream.serve_process import ROOT, ServeProcess, die_with_parent  # noqa: F401

INTEGRITY = OPT_IN
"""The checker reads the integrity framing, which a request asks for (stock framing is the
default)."""


class ServerProcess(ServeProcess):
    """`with ServerProcess("--profile", "ci") as server: httpx.get(server.url + "/health")`"""

    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout: float = 180,
                 new_session: bool = False):
        # Tests read the integrity framing (id: lines): every test server frames every stream
        # with it unless a test asks for the stock framing (--no-stream-integrity).
        integrity = () if "--no-stream-integrity" in args else ("--stream-integrity",)
        # The engine checks its block bookkeeping after every step (wait_idle reads the verdict).
        super().__init__(["--port", "0", *integrity, *args], start_timeout_s=start_timeout,
                         env={"TOKSTREAM_SELF_CHECK": "1", **(env or {})},
                         new_session=new_session)

    def state(self, **headers) -> dict:
        response = httpx.get(self.url + "/v1/state", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 60, **headers) -> dict:
        """Poll /v1/state until no request is live and every KV block is free."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(**headers)
            if not state["requests"] and state["kv"]["used_blocks"] == 0 \
                    and state["batch"]["running"] == 0 and state["batch"]["waiting"] == 0:
                kv = state["kv"]
                assert not kv.get("self_check") and not kv.get("self_check_failures"), \
                    [e for e in state["events"] if e["kind"] == "self_check_failed"]
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {json.dumps(state)[:2000]}")
            time.sleep(0.1)


def interruptible() -> None:
    """Popen's preexec_fn for a child the test stops with SIGINT: Ctrl-C's default again. A
    shell starts a background job (`make test &`, nohup) with SIGINT ignored, and a child
    inherits that, so the interrupt the test sends would be dropped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def module_server(*args: str):
    """A `server` fixture for every test of a file (`server = module_server("--profile",
    "ci")` at the top of it): one `tokstream serve ARGS`, shared by every file that asks for
    the same ARGS and stopped at the end of the session (each start is 2-4 s of the suite). A
    file hands it on idle, its blocks free and its self-check clean, or fails; a test that
    changes a server for good (kills, restarts, drains it) starts one of its own."""

    @pytest.fixture(scope="module")
    def server(shared_servers: dict):
        server = shared_servers.get(args)
        if server is None or server.process.poll() is not None:
            server = shared_servers[args] = ServerProcess(*args).start()
        yield server
        server.wait_idle()

    return server


def anthropic_body(content: str = "hello", max_tokens: int = 16, stream: bool = True,
                   **extra) -> dict:
    return {"model": "dummy:tiny", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


def openai_body(content: str = "hello", max_tokens: int = 16, stream: bool = True,
                **extra) -> dict:
    return {"model": "dummy:tiny", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


def record(client: httpx.Client, url: str, body: dict, headers: dict | None = None,
           on_event=None) -> tuple[httpx.Response, RecordedStream]:
    """POST a streaming request and record every SSE event until the server ends it;
    on_event(event), if given, sees each event as it arrives."""
    recorder = SSERecorder()
    with client.stream("POST", url, json=body, headers={**INTEGRITY, **(headers or {})}) \
            as response:
        for chunk in response.iter_bytes():
            for event in recorder.feed(chunk):
                if on_event is not None:
                    on_event(event)
    return response, recorder.stream()


async def arecord(client: httpx.AsyncClient, url: str, body: dict,
                  headers: dict | None = None) -> RecordedStream:
    recorder = SSERecorder()
    async with client.stream("POST", url, json=body,
                             headers={**INTEGRITY, **(headers or {})}) as response:
        assert response.status_code == 200, await response.aread()
        async for chunk in response.aiter_bytes():
            recorder.feed(chunk)
    return recorder.stream()


def raw_request(host: str, port: int, path: str, body: dict, rcvbuf: int | None = None
                ) -> socket.socket:
    """Send a POST on a bare socket and return it unread (a client that stops reading)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, port))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_all(sock: socket.socket, timeout: float = 60) -> bytes:
    """A raw response read to its end: the last chunk of a chunked body, or the server closing
    the connection. (The server keeps the connection open for the next request; waiting for it
    to close took its 30 s keep-alive.)"""
    sock.settimeout(timeout)
    raw = b""
    while not _chunked_body_ended(raw):
        chunk = sock.recv(65536)
        if not chunk:
            break
        raw += chunk
    return raw


def _chunked_body_ended(raw: bytes) -> bool:
    """Whether raw holds a whole chunked HTTP/1.1 response, up to its zero-size chunk."""
    head, found, body = raw.partition(b"\r\n\r\n")
    if not found or b"transfer-encoding: chunked" not in head.lower():
        return False
    while True:
        size_line, found, rest = body.partition(b"\r\n")
        if not found:
            return False
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            return rest.startswith(b"\r\n")
        if len(rest) < size + 2:
            return False
        body = rest[size + 2:]


def dechunk(raw: bytes) -> bytes:
    """The body of a raw HTTP/1.1 response with chunked transfer encoding."""
    head, _, body = raw.partition(b"\r\n\r\n")
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return bytes(out)
