"""Connections that hold the gateway's resources (issue 15): half-sent request heads and bodies
are closed at their deadlines (slowloris), connections past the cap get a clear 503, file
descriptors stay in reserve for the engine, and a caller that stops reading is cut off after
the slow-client grace even when the engine has already finished its request."""

import json
import socket
import time

import httpx
import pytest

from helpers.serving import ServerProcess, anthropic_body, raw_request

pytestmark = [pytest.mark.startup, pytest.mark.timeout(300)]

MAX_CONNECTIONS = 24


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--profile", "ci", "--header-timeout", "1", "--body-timeout", "1",
                       "--max-connections", str(MAX_CONNECTIONS),
                       "--slow-client-grace", "1") as server:
        yield server


def closed_by_server(sock: socket.socket, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes the connection (fails if it never does)."""
    sock.settimeout(timeout)
    received = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk


def test_half_sent_request_heads_are_closed(server):
    host, port = server.host_port
    socks = []
    for _ in range(MAX_CONNECTIONS - 4):
        sock = socket.create_connection((host, port))
        sock.sendall(b"GET /heal")  # and never the rest of the request line
        socks.append(sock)
    try:
        for sock in socks:
            closed_by_server(sock)
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_a_body_that_never_completes_is_refused_at_its_deadline(server):
    host, port = server.host_port
    with socket.create_connection((host, port)) as sock:
        sock.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     "application/json\r\nContent-Length: 100\r\n\r\n{\"mo".encode())
        answer = closed_by_server(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_connections_past_the_cap_get_503(server):
    host, port = server.host_port
    held = [socket.create_connection((host, port)) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = socket.create_connection((host, port))
        answer = closed_by_server(extra, timeout=10)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"connections" in answer
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 30
    while True:  # the held ones are gone (closed here, and at the header deadline)
        try:
            if httpx.get(server.url + "/health", timeout=10).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_descriptors_stay_in_reserve():
    from tokstream.server.access.connection_limits import connection_cap

    assert connection_cap(configured=0, reserve=128, descriptor_limit=1024) == 896
    assert connection_cap(configured=5000, reserve=128, descriptor_limit=1024) == 896
    assert connection_cap(configured=100, reserve=128, descriptor_limit=1024) == 100
    assert connection_cap(configured=0, reserve=128, descriptor_limit=100) >= 1


def test_a_reader_that_stopped_is_cut_off_after_the_grace_whatever_the_engine_did(server):
    host, port = server.host_port
    # A small receive window, never read: the engine finishes (1,900 tokens, under the
    # pending-token limit) while the gateway's writer is stuck on a full socket.
    sock = raw_request(host, port, "/v1/messages",
                       anthropic_body("stuck", max_tokens=1900, ignore_eos=True), rcvbuf=2048)
    try:
        deadline = time.monotonic() + 120
        while True:  # before the fix it stayed "finishing" until the client closed
            state = server.state()
            rows = state["requests"]
            if not rows:
                break
            assert time.monotonic() < deadline, json.dumps(rows)[:1000]
            time.sleep(0.2)
        assert state["kv"]["used_blocks"] == 0
        closed_by_server(sock)  # and its socket is closed
    finally:
        sock.close()
