"""An engine core that hangs while starting (here: one that never says it is ready, with a
child of its own): the start deadline kills it and everything under it, and the start fails
with a ReplicaError (the supervisor counts that as a failed attempt)."""

import asyncio
import os
import subprocess
import time

import psutil
import pytest

from tokstream.config import EngineConfig
from tokstream.engine import async_engine
from tokstream.engine.async_engine import AsyncEngine
from tokstream.errors import ReplicaError

pytestmark = [pytest.mark.startup, pytest.mark.timeout(120)]

PID_FILE_ENV = "TEST_HUNG_CORE_CHILD_PID_FILE"


def hung_core(conn, config, *args) -> None:
    """Stands in for core_main: starts a child (a rank, say), then never answers."""
    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ[PID_FILE_ENV], "w") as f:
        f.write(str(child.pid))
    while True:
        time.sleep(1)


def test_a_core_that_never_gets_ready_is_killed_with_its_children(monkeypatch, tmp_path):
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv(PID_FILE_ENV, str(pid_file))
    monkeypatch.setattr(async_engine, "core_main", hung_core)
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", start_timeout_s=3.0))

    async def start():
        # The bound is this test's, so that without a start deadline it fails, not hangs.
        await asyncio.wait_for(engine.start(), 60)

    with pytest.raises(ReplicaError, match="hung while starting"):
        asyncio.run(start())
    assert not engine.process.is_alive()
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
