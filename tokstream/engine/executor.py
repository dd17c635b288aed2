"""The executor boundary: the engine core's handle on its worker process(es).

The core never imports torch; it sends StepPlans down a pipe and reads StepResults back.
Workers are spawned (not forked) so they start clean, and they exit when the pipe closes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os

from tokstream.config import EngineConfig
from tokstream.engine.messages import ScoreRequest, ScoreResult, StepPlan, StepResult
from tokstream.errors import ReplicaError, UserInputError
from tokstream.worker.worker import WorkerFailed, WorkerReady, worker_main


# Read once by the child at start (glibc malloc, OpenMP, torch's CPU allocator). Measured on
# a batch-32 SmolLM2 run: without them, per-step buffers of a few MB are mmap'ed and unmapped
# every step (1.8M page faults, 11 s of system time in a 14 s run, prefill steps 2x slower).
WORKER_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),  # keep per-step buffers in the heap...
    "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),  # ...and never hand them back to the OS
    "THP_MEM_ALLOC_ENABLE": "1",  # torch: transparent huge pages for large tensors
}


@contextlib.contextmanager
def worker_environment(config: EngineConfig):
    """Set the children's environment for the duration of a spawn; the user's values win."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    wanted = dict(WORKER_ENV)
    if config.tp > cores:
        wanted["OMP_WAIT_POLICY"] = "PASSIVE"  # spinning ranks would starve each other
    saved = {key: os.environ.get(key) for key in wanted}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Executor:
    def __init__(self, config: EngineConfig):
        self.config = config
        context = mp.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child_conn, config, 0),
                                       name="tokstream-rank0")
        with worker_environment(config):
            self.process.start()
        child_conn.close()
        self.ready = self._wait_ready()

    def _wait_ready(self) -> WorkerReady:
        try:
            message = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise ReplicaError(f"worker exited while loading (exit code {self.process.exitcode})")
        if isinstance(message, WorkerFailed):
            self.process.join(5)
            raise (UserInputError if message.user_error else ReplicaError)(message.message)
        return message

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            self.conn.send(plan)
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise ReplicaError(f"worker died during a step: {exc!r}") from exc

    def score(self, request: ScoreRequest) -> ScoreResult:
        try:
            self.conn.send(request)
            result = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise ReplicaError(f"worker died while scoring: {exc!r}") from exc
        return result

    @property
    def pids(self) -> list[int]:
        return [self.process.pid]

    def shutdown(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
