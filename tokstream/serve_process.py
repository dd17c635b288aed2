"""A server as a child process: `tokstream serve` (or a peer's server, for the benchmarks)
started, its ready line read (or its /health polled), stopped with everything under it. The
one harness tests (tests/helpers/serving.py), chaos (chaos/target.py) and the benchmarks
(bench/serve_bench.py, bench/compare_vllm.py) start servers with.

The child gets SIGTERM when its parent dies (PR_SET_PDEATHSIG); tokstream's engine core exits
when the gateway's pipe closes and its ranks when the core's does, so a killed test run or
benchmark leaves no orphans. No torch here."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

import psutil

from tokstream.process_end import running

ROOT = Path(__file__).resolve().parents[1]
TOKSTREAM = [sys.executable, "-m", "tokstream"]
READY = re.compile(r"ready on (http://\S+)")
"""What `tokstream serve` prints on stderr once the engine is up (its URL, port included)."""
PR_SET_PDEATHSIG = 1


class ServeStartError(RuntimeError):
    """The server exited or stayed silent during start-up; the message ends with its log."""


def die_with_parent() -> None:
    """preexec_fn for a child that must get SIGTERM when the process that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class ServeProcess:
    """`with ServeProcess(["--profile", "ci", "--port", "0"]) as server: server.url`

    Output (stdout and stderr together) is kept in `log`, one line an entry with its newline,
    and copied to log_path when given."""

    def __init__(self, args: Sequence[str] = (), *, command: Sequence[str] | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path = ROOT,
                 start_timeout_s: float = 300.0, stop_timeout_s: float = 20.0,
                 new_session: bool = False, ready_url: str | None = None,
                 log_path: str | None = None, keep_lines: int | None = None,
                 reap: bool = False):
        self.command = list(command) if command is not None else [*TOKSTREAM, "serve", *args]
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.new_session = new_session
        """A process group of its own: Ctrl-C at a terminal reaches only the parent, which then
        stops the server in order; the group can be signalled whole."""
        self.ready_url = ready_url
        """Poll this URL until it answers 200 instead of reading the ready line (a server
        that prints none); `url` is then the caller's to know."""
        self.log_path = log_path
        self.keep_lines = keep_lines
        """Keep only the last lines of output (None: all)."""
        self.reap = reap
        """On stop, SIGKILL whatever of the process tree (and group) outlived the server.
        Off (tests): what outlives it stays for the test to find."""
        self.log: list[str] = []
        self.url: str | None = None
        self.process: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.stopped_by: str | None = None
        """None (it had exited), "SIGTERM" or "SIGKILL": what stop() took."""
        self._ready = threading.Event()

    def __enter__(self) -> "ServeProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def startup_s(self) -> float:
        return self.ready_at - self.started_at

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def log_tail(self, lines: int = 40) -> str:
        return "".join(self.log[-lines:])

    def start(self) -> "ServeProcess":
        """Start the server and return once it is ready; ServeStartError (the server
        stopped) when it exits or is not ready within start_timeout_s."""
        self.started_at = time.perf_counter()
        self.process = subprocess.Popen(
            self.command, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            preexec_fn=die_with_parent, start_new_session=self.new_session)
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            if self.ready_url is not None:
                self._poll_ready()
            elif not self._ready.wait(self.start_timeout_s) or self.url is None:
                raise ServeStartError(self._why_not_ready())
        except BaseException:
            self.stop()
            raise
        self.ready_at = time.perf_counter()
        return self

    def _drain(self) -> None:
        log_file = open(self.log_path, "w", encoding="utf-8") if self.log_path else None
        try:
            for line in self.process.stdout:
                self.log.append(line)
                if self.keep_lines is not None and len(self.log) > self.keep_lines:
                    del self.log[:-self.keep_lines]
                if log_file is not None:
                    log_file.write(line)
                    log_file.flush()
                match = READY.search(line) if self.url is None else None
                if match and self.ready_url is None:
                    self.url = match.group(1)
                    self._ready.set()
        finally:
            self._ready.set()  # the output ended: the server is gone
            if log_file is not None:
                log_file.close()

    def _poll_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServeStartError(self._why_not_ready())
            try:
                with urllib.request.urlopen(self.ready_url, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise ServeStartError(self._why_not_ready())

    def _why_not_ready(self) -> str:
        code = self.process.poll()
        state = (f"exited with {code}" if code is not None
                 else f"not ready after {self.start_timeout_s:g} s")
        return f"{' '.join(self.command[:4])} … {state}; its last lines:\n{self.log_tail(40)}"

    def stop(self) -> int | None:
        """SIGTERM the server (a stopped process is continued first: it would ignore it until
        then) and wait stop_timeout_s; past that, SIGKILL its whole tree. Returns its exit
        code."""
        process = self.process
        if process is None:
            return None
        tree = _tree(process.pid) if process.poll() is None else []
        if process.poll() is None:
            _each(tree, "resume")
            self.stopped_by = "SIGTERM"
            process.terminate()
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.stopped_by = "SIGKILL"
                _each(tree, "kill")
                process.kill()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self.reap:
            _each(tree, "kill")  # psutil checks identity: a reused pid is never signalled
            if self.new_session:
                deadline = time.monotonic() + 10
                while self.group_alive() and time.monotonic() < deadline:
                    _signal_group(process.pid, signal.SIGKILL)
                    time.sleep(0.05)
        return process.returncode

    def group_alive(self) -> bool:
        """Whether any process of its own session's group still runs (new_session only; a
        zombie has ended: process_end)."""
        group = self.process.pid
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == group and running(process):
                    return True
            except (OSError, psutil.Error):
                pass  # gone meanwhile
        return False


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _each(processes: list[psutil.Process], action: str) -> None:
    for process in processes:
        try:
            getattr(process, action)()
        except psutil.Error:
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
