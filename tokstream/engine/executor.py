"""The executor boundary: the engine core's handle on its worker process(es).

The core never imports torch; it sends StepPlans down a pipe and reads StepResults back.
Workers are spawned (not forked) so they start clean, and they exit when the pipe closes.
"""

from __future__ import annotations

import multiprocessing as mp
import os

from tokstream.config import EngineConfig
from tokstream.engine.messages import StepPlan, StepResult
from tokstream.errors import ReplicaError, UserInputError
from tokstream.worker.worker import WorkerFailed, WorkerReady, worker_main


class Executor:
    def __init__(self, config: EngineConfig):
        self.config = config
        context = mp.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self._set_thread_env()
        self.process = context.Process(target=worker_main, args=(child_conn, config, 0),
                                       name="tokstream-rank0")
        self.process.start()
        child_conn.close()
        self.ready = self._wait_ready()

    def _set_thread_env(self) -> None:
        # Children inherit the environment at spawn; OpenMP reads it once at start.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if self.config.tp > cores:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

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
