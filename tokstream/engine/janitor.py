"""Removes the gateway's engine-core folders when the gateway dies, however it dies.

Each engine core keeps its files in a folder of its own (`tokstream-core-*`: its ranks'
rendezvous folders, and, as the core's TMPDIR, its forkserver's socket folder and anything
else a rank puts in a temporary file). The gateway removes it when the core is done; but a
gateway SIGKILLed takes its cores and ranks with it (PR_SET_PDEATHSIG) and nothing is left to
remove their folders. So the gateway starts this watcher once, in a session of its own (a
signal to the gateway's process group does not reach it), and tells it each folder it makes
and removes, one line each on its stdin ("+PATH", "-PATH"). When stdin closes (the gateway is
gone, whatever the cause) it removes every folder still listed, retrying for up to
REMOVE_FOR_S while the dying processes may still write there, and exits: it never outlives
that.

Run as a plain script (`python -I janitor.py`): standard library only, so it starts in a few
milliseconds and imports nothing of the gateway's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

FOLDER_PREFIX = "tokstream-core-"
MAX_PARENT_CHARS = 50
"""The core's forkserver listens on a socket two folders below the core's folder
(pymp-XXXXXXXX/listener-XXXXXXXX), and a socket's path has at most 107 bytes."""
REMOVE_FOR_S = 10.0
RETRY_S = 0.1


class Janitor:
    """The gateway's end: one watcher process, started at the first folder."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def watch(self, path: str) -> None:
        """path is removed if this process dies before forget(path)."""
        self._tell(f"+{path}")

    def forget(self, path: str) -> None:
        self._tell(f"-{path}")

    def _tell(self, line: str) -> None:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._process = subprocess.Popen(
                    [sys.executable, "-I", __file__], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True, text=True)
            try:
                self._process.stdin.write(line + "\n")
                self._process.stdin.flush()
            except OSError:
                pass  # it died: the folder is still removed by whoever ends the core

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None


def make_core_folder() -> str:
    """A new engine core's folder (0700), in the temporary folder unless its path is too
    long for the forkserver's socket below it; then in /tmp."""
    parent = tempfile.gettempdir()
    if len(parent) > MAX_PARENT_CHARS:
        parent = "/tmp"
    return tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=parent)


JANITOR = Janitor()
"""The gateway process's one watcher."""


def _remove(paths: set[str]) -> None:
    deadline = time.monotonic() + REMOVE_FOR_S
    while paths and time.monotonic() < deadline:
        for path in list(paths):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):  # else a dying process wrote into it meanwhile
                paths.discard(path)
        if paths:
            time.sleep(RETRY_S)


def main() -> None:
    paths: set[str] = set()
    for line in sys.stdin:
        line = line.rstrip("\n")
        # Only an engine core's folder, whatever a confused caller sends.
        if line.startswith("+") and os.path.basename(line[1:]).startswith(FOLDER_PREFIX):
            paths.add(line[1:])
        elif line.startswith("-"):
            paths.discard(line[1:])
    _remove(paths)


if __name__ == "__main__":
    main()
