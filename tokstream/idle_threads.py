"""Threads under Linux's SCHED_IDLE policy, and the /proc reads that show a thread's policy and
CPU time. The ranks' OpenMP threads wait for each other at every barrier of a step, so any
thread at normal priority that keeps a core busy beside them (the gateway's tokenising) stalls
the whole step, often by far more than its own CPU time. The kernel preempts a SCHED_IDLE
thread the moment a normal thread wakes, and still runs it on any idle core: work that is one
request's own is slowed under load, never the steps. (A nice value of 10 or 19 did not protect
the streams in the served A/B; see README.) Only for work that holds no GIL while it runs: a
preempted idle thread holding the GIL would stop every other thread of its process. A rank's
grammar compile also drops the GIL, but under SCHED_IDLE it cost the constrained request
0.3-0.9 s for no measurable gain to the streams, so it is left as it was. Lowering a thread's
own policy needs no privilege. No torch here."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("tokstream")


def become_idle() -> bool:
    """Put the calling thread under SCHED_IDLE (threads it starts inherit it). False, with a
    warning, where the kernel refuses (a seccomp filter may)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except OSError as error:
        log.warning("SCHED_IDLE refused (%s): this thread competes with the ranks", error)
        return False
    return True


def thread_ids(pid: int | str = "self") -> set[int]:
    """A process's threads (Linux task ids)."""
    return {int(name) for name in os.listdir(f"/proc/{pid}/task")}


def policy(tid: int, pid: int | str = "self") -> int:
    """A thread's scheduling policy (os.SCHED_OTHER, os.SCHED_IDLE, ...)."""
    return int(_stat(pid, tid)[38])


def cpu_ticks(tid: int, pid: int | str = "self") -> int:
    """The CPU time a thread has used (user and system), in clock ticks."""
    fields = _stat(pid, tid)
    return int(fields[11]) + int(fields[12])


def _stat(pid: int | str, tid: int) -> list[str]:
    """/proc's stat fields of a thread after its name (field 3 onwards)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()
