"""How rank processes start: forked from a forkserver that has the ranks' imports done.

A rank spawned afresh spent longer importing (torch alone 1.2-1.4 s, and tp ranks importing
at once on the same cores) than loading its weights from the cache, on every start and every
restart of a rank group. The engine core therefore starts one forkserver (multiprocessing's:
a clean process started with exec, not a copy of the core) that imports RANK_PRELOAD once;
every rank of every group of that core is forked from it, ready to load. The forkserver dies
with the core (forkserver_guard), and its ranks with it (PR_SET_PDEATHSIG, child_process).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os

from tokstream.config import EngineConfig
from tokstream.engine.child_process import become_child
from tokstream.engine.forkserver_guard import GUARD_ENV
from tokstream.worker.worker import worker_main

# Read once by the child at start (glibc malloc, OpenMP, torch's CPU allocator). Measured on
# a batch-32 SmolLM2 run: without them, per-step buffers of a few MB are mmap'ed and unmapped
# every step (1.8M page faults, 11 s of system time in a 14 s run, prefill steps 2x slower).
WORKER_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),  # keep per-step buffers in the heap...
    "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),  # ...and never hand them back to the OS
    "THP_MEM_ALLOC_ENABLE": "1",  # torch: transparent huge pages for large tensors
}
RANK_PRELOAD = ["tokstream.engine.forkserver_guard", "torch", "torch.distributed",
                "tokstream.model.weights", "tokstream.tokenizer", "tokstream.worker.model_runner",
                "tokstream.worker.quant_linear", "tokstream.worker.dtype_choice",
                "tokstream.worker.backend", "tokstream.worker.grammar"]
"""What the forkserver imports: its guard, then what a rank imports before it loads. A name
that fails to import is skipped by the forkserver (the rank then imports it itself)."""

_forkserver_env: dict[str, str] | None = None
"""The environment the running forkserver started with (multiprocessing keeps one per
process): its children inherit it, OpenMP's settings included, read when torch loaded."""


@contextlib.contextmanager
def worker_environment(config: EngineConfig):
    """Set the ranks' environment for the duration of a start; the user's values win. Yields
    the values in force."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    wanted = dict(WORKER_ENV)
    if config.tp > cores:
        wanted["OMP_WAIT_POLICY"] = "PASSIVE"  # spinning ranks would starve each other
    saved = {key: os.environ.get(key) for key in wanted}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    try:
        yield {key: os.environ[key] for key in wanted}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rank_context(config: EngineConfig):
    """The multiprocessing context ranks start from, its forkserver running with config's
    rank environment (started now if it is not: call early, it preloads meanwhile)."""
    global _forkserver_env
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    with worker_environment(config) as env:
        if _forkserver_env is not None and env != _forkserver_env:
            # Another tp in this process (tests, offline use): ranks forked now must get
            # this environment. A group still running from the old forkserver dies with it.
            forkserver._forkserver._stop()
        os.environ[GUARD_ENV] = str(os.getpid())  # read (and dropped) by a new forkserver
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(GUARD_ENV, None)
        _forkserver_env = env
    return context


def rank_main(*args) -> None:
    """A rank's process: dies with the forkserver (which exits with the core), leaves SIGTERM
    to the core (child_process)."""
    become_child()
    worker_main(*args)
