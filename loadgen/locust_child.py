"""The Locust child process, seen from the parent: start it, follow its progress, stop it.

`python -m tokstream.loadgen.locust_run RUN.json` gets everything as one JSON file (deleted as
soon as the child ends: it holds the tenants' keys) and writes one JSON line of progress a
second, then a 'done' line. The child dies with this process (PR_SET_PDEATHSIG), a watchdog
kills one that stops talking, and Ctrl-C asks it to stop (SIGTERM): it cancels what is in
flight, records it and ends, so what was measured is still reported.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_locust(config: dict, out: Path, limit_s: float) -> dict:
    """Run the Locust child to its end; returns its last 'done' payload ({} if it died)."""
    config_path = out / "locust_run.json"
    config_path.write_text(json.dumps(config), encoding="utf-8")
    log = open(out / "locust.log", "w", encoding="utf-8")
    child = subprocess.Popen([sys.executable, "-m", "tokstream.loadgen.locust_run",
                              str(config_path)], stdout=subprocess.PIPE, stderr=log,
                             stdin=subprocess.DEVNULL, text=True, preexec_fn=_die_with_parent)
    progress = Progress()
    watchdog = threading.Timer(limit_s, child.kill)  # a child that stops talking still ends
    watchdog.start()
    try:
        try:
            done = _follow(child, progress)
        except KeyboardInterrupt:
            # Ctrl-C stops the run, not the report: the child cancels what is in flight,
            # records it and ends; what was measured is still summarised.
            child.send_signal(signal.SIGTERM)
            done = {**_follow(child, progress), "interrupted": True}
    finally:
        watchdog.cancel()
        progress.close()
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        log.close()
        config_path.unlink(missing_ok=True)  # it holds the tenants' keys
    log_text = (out / "locust.log").read_text(encoding="utf-8")
    if not log_text:
        (out / "locust.log").unlink()
    if done.get("interrupted"):
        print("interrupted: the report covers the requests recorded so far", file=sys.stderr)
    elif child.returncode not in (0, -signal.SIGTERM) or not done:
        print(f"warning: the Locust process ended early (exit {child.returncode}); the report "
              f"covers what it recorded. Its log:\n{log_text[-2000:]}", file=sys.stderr)
    return done


def _follow(child: subprocess.Popen, progress: "Progress") -> dict:
    """Show the child's progress lines until it ends; its 'done' payload ({} if none)."""
    done: dict = {}
    for line in child.stdout:
        message = json.loads(line)
        if "web" in message:
            print(f"Locust web UI: {message['web']['url']}", file=sys.stderr)
        progress.show(message.get("progress") or message.get("done"))
        done = message.get("done", done)
    return done


class Progress:
    """One live line on stderr (rewritten in place on a terminal, every 10 s otherwise)."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.printed_at = 0.0

    def show(self, p: dict | None) -> None:
        if not p:
            return
        line = (f"{p['elapsed_s']:7.1f} s  sent {p['issued']}  ok {p['completed']}  "
                f"failed {p['failed']}  in flight {p['in_flight']}  "
                f"output tokens {p['output_tokens']}")
        if self.tty:
            sys.stderr.write("\r" + line.ljust(100))
            sys.stderr.flush()
        elif time.monotonic() - self.printed_at >= 10:
            print(line, file=sys.stderr)
            self.printed_at = time.monotonic()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
