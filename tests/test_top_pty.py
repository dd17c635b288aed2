"""`tokstream top` run as an operator runs it, in a pseudo-terminal, against an HTTP server
whose every request carries a caller's terminal escapes (issue 31 item 5): the bytes the real
process writes to its terminal, on the main screen and in a request's detail, hold none of the
caller's sequences, only their visible escapes."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from helpers.top_replay import FRAMES
from test_top import followed_request
from test_top_escapes import HOSTILE

ROWS, COLS = 50, 160
RAW_PAYLOADS = (b"\x1b]0;pwned", b"\x1b[31mred", "\x9b1m".encode(), "\u202e".encode(),
                b"t\x1b[8m", b"\x08\x00end")
"""The caller's sequences as bytes a terminal would act on (U+009B and U+202E in UTF-8)."""
DEADLINE_S = 60.0


def hostile_frame() -> tuple[dict, dict]:
    """(the /v1/state reply, one detail reply) with every request's tenant, text and stop
    strings hostile."""
    start, request_id, _ = followed_request()
    frame = FRAMES[start]
    state = copy.deepcopy(frame["state"])
    for request in state["requests"]:
        request["tenant"] = "t\x1b[8m"
    detail = copy.deepcopy(frame["requests"][request_id])
    detail.update(recent_text=HOSTILE, tenant="t\x1b[8m")
    detail["params"]["stop"] = [HOSTILE]
    return state, detail


class HostileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.state, self.detail = hostile_frame()
        self.metrics = FRAMES[0]["metrics"]
        self.detail_asked = threading.Event()
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(BaseHTTPRequestHandler):
    server: HostileServer

    def do_GET(self):
        if self.path == "/v1/state":
            self.reply(json.dumps(self.server.state), "application/json")
        elif self.path == "/metrics":
            self.reply(self.server.metrics, "text/plain")
        elif self.path.startswith("/v1/state/requests/"):
            # Whichever row the cursor is on: it is the hostile request.
            detail = dict(self.server.detail, id=self.path.rsplit("/", 1)[1])
            self.reply(json.dumps(detail), "application/json")
            self.server.detail_asked.set()
        else:
            self.send_error(404)

    def reply(self, body: str, kind: str) -> None:
        data = body.encode()
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class Terminal:
    """A child process on a pseudo-terminal of ROWS x COLS; everything it writes is kept."""

    def __init__(self, argv: list[str]):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(COLS), LINES=str(ROWS))
        self.process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                        start_new_session=True)
        os.close(slave)
        self.written = bytearray()

    def read_until(self, *wanted: bytes, since: int = 0, timeout_s: float = DEADLINE_S) -> bool:
        """Whether any of `wanted` was written (after byte `since`) within timeout_s."""
        end = time.monotonic() + timeout_s
        while not any(w in self.written[since:] for w in wanted):
            if time.monotonic() > end or not self.pump(0.2):
                return any(w in self.written[since:] for w in wanted)
        return True

    def pump(self, wait_s: float) -> bool:
        """Read what is there within wait_s; False once the child has closed its side."""
        ready, _, _ = select.select([self.master], [], [], wait_s)
        if ready:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return False
            if not chunk:
                return False
            self.written += chunk
        return True

    def settle(self, quiet_s: float = 1.0) -> None:
        end = time.monotonic() + quiet_s
        while time.monotonic() < end and self.pump(0.1):
            pass

    def send(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> int | None:
        try:
            return self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return None
        finally:
            os.close(self.master)


def test_the_top_process_writes_no_callers_escape_to_its_terminal():
    server = HostileServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    terminal = Terminal([sys.executable, "-m", "tokstream", "top", "--url", url,
                         "--interval", "0.5"])
    try:
        # The main screen's requests table lists the hostile tenant (escaped, or not).
        assert terminal.read_until(b"t\\x1b[8m", b"t\x1b[8m"), bytes(terminal.written[-2000:])
        opened = len(terminal.written)
        terminal.send(b"\r")
        assert server.detail_asked.wait(DEADLINE_S), "Enter opened no request"
        assert terminal.read_until(b"pwned", since=opened), bytes(terminal.written[-2000:])
        terminal.settle()
        terminal.send(b"\x1b")  # back to the main screen, then quit
        terminal.settle()
        terminal.send(b"q")
        terminal.settle()
    finally:
        status = terminal.close()
        server.shutdown()
    written = bytes(terminal.written)
    assert status == 0, written[-2000:]
    assert b"t\\x1b[8m" in written[:opened]
    shown = written[opened:]
    assert b"\\x1b]0;pwned" in shown and b"\\u202etxt.exe" in shown, shown[-3000:]
    for payload in RAW_PAYLOADS:
        assert payload not in written, (payload, written[max(0, written.find(payload) - 200):]
                                        [:400])
