"""The tokenizers library's worker threads, started under Linux's SCHED_IDLE policy. Its batch
calls (long prompts, many messages, count_tokens) run on one process-wide pool of threads that
hold no GIL. At normal priority those threads took the cores from the ranks' OpenMP threads,
which wait for each other at every barrier of a step: on 2 cores, count_tokens on 6,000
messages (~0.4 s of tokenising) stalled the streams decoding beside it for 200-390 ms in a
third of the runs (issue 31 item 4). A SCHED_IDLE thread gives its core up the moment a normal
thread wakes (the kernel preempts it at once; a nice value only shrinks its share), so the
request that asked for the tokenising waits for it instead of everyone else. It still runs on
any idle core, and gets a small share of a busy one, so it is slowed, never stopped.

Linux gives a new thread its creator's policy, and the pool starts on its first batch call; so
that first call is made here, from a thread that has put itself under SCHED_IDLE. Lowering a
thread's own policy needs no privilege. No torch here."""

from __future__ import annotations

import logging
import os
import threading
import time

from tokenizers import Tokenizer as BackendTokenizer

log = logging.getLogger("tokstream.text")


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


def start_idle_pool(backend: BackendTokenizer) -> list[int]:
    """Start the tokenizers pool from a SCHED_IDLE thread, so its workers run under that policy.
    Returns the workers' thread ids: empty where the pool was already running (its workers keep
    the policy they started with; a warning says so), or where tokenizers runs serially
    (TOKENIZERS_PARALLELISM=false: batches then run on the calling thread)."""
    before = thread_ids()

    def first_batch() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        except OSError as error:  # a seccomp filter may refuse it; the pool still starts
            log.warning("SCHED_IDLE refused (%s)", error)
        backend.encode_batch(["start the pool"] * 4, add_special_tokens=False)

    starter = threading.Thread(target=first_batch, name="tokenizer-pool-start")
    starter.start()
    starter.join()
    _wait_gone(starter.native_id)
    # Only the starter's offspring inherit its policy (any other new thread keeps the normal one).
    workers = sorted(tid for tid in thread_ids() - before
                     if tid != starter.native_id and _policy_or_none(tid) == os.SCHED_IDLE)
    if not workers:
        log.warning("the tokenizers pool was not started under SCHED_IDLE: it was running "
                    "already, or parallelism is off; its tokenising competes with the ranks")
    return workers


def _wait_gone(tid: int, limit_s: float = 2.0) -> None:
    """Wait until an ended thread has left /proc: a listing taken while it leaves can miss
    other threads (the pool's first worker went missing in one listing of ten)."""
    deadline = time.monotonic() + limit_s
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.001)


def _policy_or_none(tid: int) -> int | None:
    try:
        return policy(tid)
    except FileNotFoundError:  # a thread that has ended since
        return None
