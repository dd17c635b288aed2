"""The tokenizers library's worker threads, started under SCHED_IDLE (idle_threads.py). A
batch call of several texts (encode_chat's messages with special-token text, count_tokens over
them) runs on one process-wide pool of threads that hold no GIL; one text, however long, is
tokenised on the calling thread. At normal priority the pool took the cores from the ranks: on
2 cores, count_tokens on 6,000 messages (~0.4 s of tokenising) stalled the streams decoding
beside it for 265-552 ms in half the runs (issue 31 item 4). Under SCHED_IDLE the request waits
for its own tokenising instead: against two threads that never sleep, an idle thread got 3% of
a core, so under full load such a request is that much slower.

Linux gives a new thread its creator's policy, and the pool starts on its first batch call; so
that first call is made here, from a thread that has put itself under SCHED_IDLE. No torch
here."""

from __future__ import annotations

import logging
import os
import threading
import time

from tokenizers import Tokenizer as BackendTokenizer

from tokstream.idle_threads import become_idle, policy, thread_ids

log = logging.getLogger("tokstream.text")


def start_idle_pool(backend: BackendTokenizer) -> list[int]:
    """Start the tokenizers pool from a SCHED_IDLE thread, so its workers run under that policy.
    Returns the workers' thread ids: empty where the pool was already running (its workers keep
    the policy they started with; a warning says so), or where tokenizers runs serially
    (TOKENIZERS_PARALLELISM=false: batches then run on the calling thread)."""
    before = thread_ids()

    def first_batch() -> None:
        become_idle()  # refused: the pool still starts, at normal priority
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
