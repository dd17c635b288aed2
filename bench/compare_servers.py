"""The processes a comparison starts: each contender's server in its own process group, the
bounded client runs, and the log line every step writes."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokstream.serve_process import ServeProcess  # noqa: E402

MODEL_NAME = "smollm2"  # every server serves the model under this name


def log(msg: str) -> None:
    print(f"[compare_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Server:
    """A contender's server (vLLM, llama-server or tokstream serve) through the one serve
    harness (tokstream.serve_process): its own process group, ready when /health answers 200,
    stopped with SIGTERM, SIGKILL after 30 s, then the whole group swept."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: str, port: int):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.process = ServeProcess(command=cmd, env=env, log_path=log_path, new_session=True,
                                    reap=True, stop_timeout_s=30, keep_lines=200,
                                    ready_url=f"http://127.0.0.1:{port}/health")

    def wait_healthy(self, timeout: float) -> float:
        """Start it; seconds from start until /health answered 200; raises on exit or
        timeout (with the last log lines)."""
        self.process.start_timeout_s = timeout
        log(f"{self.name}: starting on 127.0.0.1:{self.port} (log {self.log_path})")
        self.process.start()
        log(f"{self.name}: pid {self.process.pid}")
        return self.process.startup_s

    def stop(self) -> dict:
        """Reports what stopping took."""
        if self.process.process is None:
            return {"exit_status": None, "stopped_by": None, "group_left_running": False}
        exit_status = self.process.stop()
        info = {"exit_status": exit_status, "stopped_by": self.process.stopped_by,
                "group_left_running": self.process.group_alive()}
        log(f"{self.name}: stopped ({info})")
        return info


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_bounded(cmd: list[str], log_path: str, timeout: float, env: dict | None = None) -> int:
    """Run a client command in its own group, output to log_path; kill the group on timeout."""
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[compare_vllm] killed after {timeout:.0f} s\n".encode())
            return -signal.SIGKILL
        finally:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmdline(cmd: list[str], env: dict | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)
