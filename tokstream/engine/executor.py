"""The executor boundary: the engine core's handle on its worker process(es).

The core never imports torch; it sends StepPlans down a pipe and reads StepResults back.
Ranks start from the core's forkserver (rank_start) and exit when the pipe closes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection as mp_connection
import os
import pickle
import shutil
import signal
import tempfile
import time

from tokstream import envs
from tokstream.config import EngineConfig
from tokstream.engine.messages.rank import WorkerFailed, WorkerReady
from tokstream.engine.messages.worker import ScoreRequest, ScoreResult, StepPlan, StepResult
from tokstream.engine.recovery.pool_files import PoolFiles, PoolPaths
from tokstream.engine.rank_start import rank_context, rank_main
from tokstream.errors import ReplicaError, UserInputError


@dataclasses.dataclass(frozen=True)
class Poison:
    """A fault injected by token id (TOKSTREAM_POISON, tokstream/envs.py)."""

    victim: str
    """rank (rank 0) or core (the engine core process)."""
    token_id: int

    @classmethod
    def from_env(cls) -> "Poison | None":
        value = envs.POISON.get()
        if not value:
            return None
        victim, _, token = value.partition(":")
        if victim not in ("rank", "core") or not token.isdigit():
            raise UserInputError(f"{envs.POISON.name} must be rank:TOKEN or core:TOKEN, not {value!r}")
        return cls(victim, int(token))

    def strike(self, plan: StepPlan, group: "RankGroup") -> None:
        if not any(chunk.start_position == 0 and chunk.token_ids[:1] == [self.token_id]
                   for chunk in plan.chunks):
            return
        if self.victim == "core":
            os.kill(os.getpid(), signal.SIGKILL)
        group.processes[0].kill()
        group.processes[0].join(5)




class RankGroup:
    """The tensor-parallel ranks of one replica: spawned together, one unit when any fails."""

    def __init__(self, config: EngineConfig, run_dir: str | None = None,
                 pool_files: tuple[str, ...] | None = None):
        self.config = config
        context, environment = rank_context(config)
        # A rendezvous file unique to this group: two servers (or a group and its spare)
        # never meet by accident, and no port is claimed. Under run_dir, which the gateway
        # removes even when this core could not (it was killed).
        self._tmpdir = tempfile.mkdtemp(prefix="tokstream-ranks-", dir=run_dir)
        self.spawned_at = time.monotonic()
        self.ready_at: float | None = None
        """When the last rank reported ready (wait_ready)."""
        rendezvous = os.path.join(self._tmpdir, "rendezvous")
        self.conns = []
        self.processes = []
        for rank in range(config.tp):
            parent_conn, child_conn = context.Pipe()
            process = context.Process(target=rank_main,
                                      args=(environment, child_conn, config, rank, rendezvous,
                                            pool_files and pool_files[rank]),
                                      name=f"tokstream-rank{rank}")
            process.start()
            child_conn.close()
            self.conns.append(parent_conn)
            self.processes.append(process)
        self.ready: list[WorkerReady] = []

    def wait_ready(self) -> list[WorkerReady]:
        """Every rank's WorkerReady; raises on a failed or dead rank, or past the deadline,
        once the whole group is killed and its folder removed (a rank killed while loading, by
        the OOM killer say, left its group's other ranks loading and its folder behind)."""
        deadline = time.monotonic() + self.config.start_timeout_s
        try:
            for conn in self.conns:
                message = self._receive(conn, deadline, "loading", self.config.start_timeout_s)
                if isinstance(message, WorkerFailed):
                    raise (UserInputError if message.user_error else ReplicaError)(
                        message.message)
                self.ready.append(message)
        except BaseException:
            self.kill()
            raise
        self.ready_at = time.monotonic()
        return self.ready

    def _receive(self, conn, deadline: float, doing: str, timeout_s: float):
        """conn's next message, watching every rank: a death or the deadline raises."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplicaError(f"rank group hung while {doing} "
                                   f"(no answer in {timeout_s:g} s)")
            ready = mp_connection.wait([conn, *sentinels], timeout=remaining)
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    pass  # the rank died: its sentinel tells which
            for sentinel in ready:
                if sentinel in sentinels:
                    rank = sentinels[sentinel]
                    code = self.processes[rank].exitcode
                    raise ReplicaError(f"rank {rank} (pid {self.processes[rank].pid}) died "
                                       f"while {doing} (exit code {code})")

    def broadcast(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except (OSError, BrokenPipeError) as exc:
            raise ReplicaError(f"a rank is gone: {exc!r}") from exc

    def call(self, message, doing: str):
        """Send message to every rank and return rank 0's answer (within the step deadline)."""
        self.broadcast(message)
        timeout_s = self.config.step_timeout_s
        return self._receive(self.conns[0], time.monotonic() + timeout_s, doing, timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self.processes]

    def pool_layout(self) -> list[tuple] | None:
        """Every rank's pool layout (WorkerReady.pool_layout) if every rank's pool is in the
        pool files (engine/recovery/pool_files.py), else None."""
        if len(self.ready) != self.config.tp or not all(r.kv_shared for r in self.ready):
            return None
        return [r.pool_layout() for r in self.ready]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, BrokenPipeError):
                pass
        for process in self.processes:
            process.join(10)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank still there (also un-stops a SIGSTOPped one) and reap them."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def exited(self) -> bool:
        """Every rank process has exited (been reaped)."""
        return all(p.exitcode is not None for p in self.processes)


class Executor:
    """The engine core's handle on its rank group (and a warm spare, with config.spare)."""

    def __init__(self, config: EngineConfig, run_dir: str | None = None,
                 pool: PoolPaths | None = None):
        self.config = config
        self.run_dir = run_dir
        """Where rank groups keep their files (None: the system's temp folder)."""
        self._own_pool = PoolFiles(config.tp) if pool is None else None
        self.pool = pool or self._own_pool.paths()
        """The ranks' KV pools on the host (the gateway's, else this core's own): every group
        of this core maps the same ones."""
        self.pool_files = self.pool.ranks if self.pool is not None else None
        self.pool_kept = False
        """The last restart's group reads the pool the failed one wrote (restart)."""
        self.group = RankGroup(config, run_dir, self.pool_files)
        ready = self.group.wait_ready()
        # The ranks of a group agree on one pool size (worker._fewest_blocks); min() holds
        # for a group of any make.
        self.ready = min(ready, key=lambda r: r.num_blocks)
        # Later groups (the spare, restarts) get exactly this pool size, whatever memory is
        # free when they start.
        self.group_config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, num_blocks=self.ready.num_blocks))
        self.keep_spare = config.spare
        """Keep a standby group loaded (config.spare, or armed by arm_spare)."""
        self.spare: RankGroup | None = None
        self.reload_spare()
        self.poison = Poison.from_env()

    def execute(self, plan: StepPlan) -> StepResult:
        if self.poison is not None:
            self.poison.strike(plan, self.group)
        return self.group.call(plan, "running a step")

    def score(self, request: ScoreRequest) -> ScoreResult:
        return self.group.call(request, "scoring")

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    def alive(self) -> list[bool]:
        return self.group.alive()

    def restart(self) -> float:
        """Replace a failed group: swap in the spare if it is ready, else spawn and load a new
        one. Returns the seconds spent. Raises ReplicaError if the new group fails too."""
        started = time.monotonic()
        failed = self.group
        failed.kill()
        self.pool_kept = False
        if self.spare is not None:
            self.group, self.spare = self.spare, None
        else:
            self.group = RankGroup(self.group_config, self.run_dir, self.pool_files)
        try:
            ready = self.group.wait_ready() if not self.group.ready else self.group.ready
        except UserInputError as exc:  # e.g. the model files went away since the first start
            raise ReplicaError(f"restart failed: {exc}") from exc
        if min(r.num_blocks for r in ready) < self.ready.num_blocks:
            raise ReplicaError("the restarted rank group has a smaller KV pool")
        # Trusted only if no rank of the failed group can still write to it, and the new
        # ranks read its bytes as the old ones wrote them.
        layout = failed.pool_layout()
        self.pool_kept = (layout is not None and failed.exited()
                          and self.group.pool_layout() == layout)
        return time.monotonic() - started

    def reload_spare(self) -> None:
        """Start loading a standby group, if one is kept and there is none (the engine core
        calls this once the requests a restart resumed have their next token: loading a group
        takes the cores their re-prefill needs)."""
        if self.keep_spare and self.spare is None:
            self.spare = RankGroup(self.group_config, self.run_dir, self.pool_files)

    def arm_spare(self) -> None:
        """Keep a standby group from now on (a spare engine core, once it takes over)."""
        self.keep_spare = True
        self.reload_spare()

    def shutdown(self) -> None:
        self.group.shutdown()
        if self.spare is not None:
            self.spare.shutdown()
        if self._own_pool is not None:
            self._own_pool.close()
