"""When a process has ended: once it is a zombie, not once it is reaped.

A process whose parent died before it (a killed core's forkserver and ranks, a killed
gateway's tree) is reaped by init, and the init of these VMs reaps an orphan 1.5-1.8 s after
its death (measured). psutil.wait_procs counts such a zombie as running until then, so every
wait for a tree to end took ~2 s longer than the tree did. A zombie runs no code and holds no
memory, file or socket: it has ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil

POLL_S = 0.01


def running(process: psutil.Process) -> bool:
    """Whether process still runs (False once it is a zombie, gone, or its pid reused)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_ended(processes: Iterable[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to timeout_s for every one of processes to end; those still running then."""
    left = list(processes)
    deadline = time.monotonic() + timeout_s
    while left := [process for process in left if running(process)]:
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return left
