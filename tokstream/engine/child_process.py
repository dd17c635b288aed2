"""How the engine core and the ranks live as child processes: they die with their parent, and
leave the stop signals to it.

A SIGTERM or Ctrl-C sent to the whole process group (systemd's default, a terminal) reaches
every process at once; the gateway alone decides what stops when (it drains the streams
first), so the children ignore those signals and are stopped by their parent. If the parent
itself dies, the kernel kills them (PR_SET_PDEATHSIG): no orphan outlives it, even one that
is stopped or busy loading. A rank's parent is its core's forkserver, which exits when the core
does (and ignores SIGTERM as the core does: it inherits the core's ignored signals).
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def become_child(parent_pid: int | None = None) -> None:
    """Call first thing in a child started by parent_pid (None: by whichever process forked
    it, such as a forkserver): die with it, ignore the group's stop signals."""
    expected = os.getppid() if parent_pid is None else parent_pid
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return  # not Linux: the pipe-closed exit remains
    if os.getppid() != expected:
        os._exit(1)  # the parent died before the signal was armed
