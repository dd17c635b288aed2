"""How rank processes start: forked from a forkserver that has the ranks' imports done.

A rank spawned afresh spent longer importing (torch alone 1.2-1.4 s, and tp ranks importing
at once on the same cores) than loading its weights from the cache, on every start and every
restart of a rank group. The engine core therefore starts one forkserver (multiprocessing's:
a clean process started with exec, not a copy of the core) that imports RANK_PRELOAD once;
every rank of every group of that core is forked from it, ready to load. The forkserver dies
with the core (forkserver_guard), and its ranks with it (PR_SET_PDEATHSIG, child_process).

A forked rank would inherit the environment the forkserver started with, not the one in force
when its group starts (a test's TOKSTREAM_KERNELS, a chaos run's TOKSTREAM_POISON, set after
an earlier engine of the process started the forkserver). So each rank is handed the starting
process's environment and takes it on before anything reads it; only variables read before
that, as the forkserver itself starts and preloads (STARTUP_ENV), need a new forkserver.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os

from tokstream.config import EngineConfig
from tokstream.cpu_budget import usable_cores
from tokstream.engine.child_process import become_child
from tokstream.engine.forkserver_guard import GUARD_ENV

# Read once by the child at start (glibc malloc, OpenMP, torch's CPU allocator). Measured on
# a batch-32 SmolLM2 run: without them, per-step buffers of a few MB are mmap'ed and unmapped
# every step (1.8M page faults, 11 s of system time in a 14 s run, prefill steps 2x slower).
WORKER_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),  # keep per-step buffers in the heap...
    "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),  # ...and never hand them back to the OS
    "THP_MEM_ALLOC_ENABLE": "1",  # torch: transparent huge pages for large tensors
}
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
"""The ranks of a group share one host: every socket between them is on loopback. Without an
interface named, gloo binds the address the host name resolves to (a pod's IP under
Kubernetes, where /etc/hosts maps it), open to the cluster and unauthenticated. Not the
user's to change: no rank talks to another host."""
RANK_PROGRAM = ("tokstream.worker.worker", "worker_main")
"""The module and function a rank runs. Named, not imported: the engine starts ranks and
speaks to them only through engine/messages, so engine/ imports nothing of worker/ (which
imports those messages); the forkserver has the module preloaded (RANK_PRELOAD)."""
RANK_PRELOAD = ["tokstream.engine.forkserver_guard", "torch", "torch.distributed",
                "tokstream.model.weights", "tokstream.text.tokenizer", "tokstream.worker.model_runner",
                "tokstream.worker.quant_linear", "tokstream.worker.dtype_choice",
                "tokstream.worker.backend", "tokstream.worker.grammar",
                "tokstream.worker.worker"]
"""What the forkserver imports: its guard, then what a rank imports before it loads. A name
that fails to import is skipped by the forkserver (the rank then imports it itself)."""

STARTUP_ENV = ("OMP_", "KMP_", "GOMP_", "MKL_", "MALLOC_", "THP_", "LD_", "PYTHON", "TRITON_",
               "TORCH_")
"""Prefixes of the variables read as the forkserver starts and preloads (glibc's malloc, the
loader, Python, OpenMP and torch as they load): a rank cannot change them afterwards."""

_forkserver_env: dict[str, str] | None = None
"""The STARTUP_ENV variables the running forkserver started with (multiprocessing keeps one
forkserver per process)."""


def startup_environment(environment: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in environment.items() if key.startswith(STARTUP_ENV)}


@contextlib.contextmanager
def worker_environment(config: EngineConfig):
    """Set the ranks' environment for the duration of a start; the user's values win, but
    LOOPBACK_ENV's."""
    wanted = dict(WORKER_ENV)
    if config.tp > usable_cores():
        wanted["OMP_WAIT_POLICY"] = "PASSIVE"  # spinning ranks would starve each other
    saved = {key: os.environ.get(key) for key in wanted}
    saved |= {key: os.environ.get(key) for key in LOOPBACK_ENV}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    os.environ.update(LOOPBACK_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rank_context(config: EngineConfig):
    """(the multiprocessing context ranks start from, the environment to hand them): its
    forkserver runs with config's rank environment (started now if it is not: call early, it
    preloads meanwhile)."""
    global _forkserver_env
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    with worker_environment(config):
        environment = dict(os.environ)
        startup = startup_environment(environment)
        if _forkserver_env is not None and startup != _forkserver_env:
            # Another tp, or OpenMP settings changed, in this process (tests, offline use):
            # ranks forked now must start with these. A group still running from the old
            # forkserver dies with it.
            forkserver._forkserver._stop()
        os.environ[GUARD_ENV] = str(os.getpid())  # read (and dropped) by a new forkserver
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(GUARD_ENV, None)
        _forkserver_env = startup
    return context, environment


def rank_main(environment: dict[str, str], *args) -> None:
    """A rank's process: takes on the environment its group started with (the forkserver's is
    older), dies with the forkserver (which exits with the core), leaves SIGTERM to the core
    (child_process)."""
    os.environ.clear()
    os.environ.update(environment)
    become_child()
    module, function = RANK_PROGRAM
    getattr(importlib.import_module(module), function)(*args)
