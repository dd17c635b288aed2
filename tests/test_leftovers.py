"""What a server leaves behind: nothing. Every rank group's rendezvous folder goes, on
restarts and at shutdown; ranks (and the forkserver they are forked from) die with their
engine core (PR_SET_PDEATHSIG) and the gateway
kills the recorded rank pids of a core that died; a replacement core keeps the pool size."""

import dataclasses
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from helpers.serving import ServerProcess, anthropic_body, record
from tokstream.config import CacheConfig, EngineConfig
from tokstream.engine.executor import RankGroup
from tokstream.errors import ReplicaError
from tokstream.process_end import wait_ended
from tokstream.server.replica.supervisor import replacement_config


pytestmark = pytest.mark.timeout(180)


def rank_folders(tmp) -> list[str]:
    """The engine cores' and rank groups' folders under tmp, at any depth."""
    return sorted(os.path.relpath(os.path.join(root, name), tmp)
                  for root, dirs, _ in os.walk(tmp) for name in dirs
                  if name.startswith(("tokstream-ranks-", "tokstream-core-")))


@pytest.fixture
def short_tmp():
    """A TMPDIR short enough that the cores' folders go in it (janitor.MAX_PARENT_CHARS)."""
    path = tempfile.mkdtemp(prefix="tl-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def wait_for(predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.startup
def test_no_rank_folder_or_process_outlives_restarts_and_shutdown(short_tmp):
    tmp_path = short_tmp
    with ServerProcess("--profile", "ci", "--tp", "2", env={"TMPDIR": str(tmp_path)}) as server:
        client = httpx.Client(base_url=server.url, timeout=60)
        state = server.state()
        first_ranks = [psutil.Process(r["pid"]) for r in state["ranks"]]
        os.kill(first_ranks[0].pid, signal.SIGKILL)  # a rank restart, at the next step
        response, _ = record(client, "/v1/messages", anthropic_body("hi", max_tokens=4))
        assert response.status_code == 200
        wait_for(lambda: server.state()["replica"]["restarts"] == 1)
        state = server.state()
        core = psutil.Process(state["engine"]["pid"])
        below = core.children(recursive=True)  # its ranks and the forkserver they come from
        forkserver = [p for p in core.children() if "forkserver" in " ".join(p.cmdline())]
        assert len(forkserver) == 1, [p.cmdline() for p in below]
        # A stopped process notices nothing: only PR_SET_PDEATHSIG or the gateway's kill of
        # the recorded pids ends it.
        psutil.Process(state["ranks"][0]["pid"]).suspend()
        forkserver[0].suspend()
        core.kill()  # an engine core restart: nothing under it may outlive it
        wait_for(lambda: server.state()["replica"]["restarts"] == 2)
        alive = wait_ended(first_ranks + below, 30)
        assert not alive, alive
        response, _ = record(client, "/v1/messages", anthropic_body("hi", max_tokens=4))
        assert response.status_code == 200
        client.close()
        # The live core's, with its group's inside: the dead core's is removed by its shutdown,
        # which runs beside its replacement (supervisor._reaping), so it may take a moment.
        wait_for(lambda: len(rank_folders(tmp_path)) == 2, timeout=30)
        tree = [psutil.Process(server.process.pid)] + psutil.Process(
            server.process.pid).children(recursive=True)
    alive = wait_ended(tree, 30)
    assert not alive, alive
    assert rank_folders(tmp_path) == []


def test_a_replacement_core_keeps_the_pool_size():
    config = EngineConfig(model="dummy:tiny", cache=CacheConfig(kv_cache_memory=2**20))
    replaced = replacement_config(config, {"num_blocks": 321})
    assert replaced.cache.num_blocks == 321
    assert dataclasses.replace(replaced, cache=config.cache) == config


def memory_files(processes) -> dict[str, set[int]]:
    """name -> the modes of the memfds the processes hold (KV pools, block index, all-reduce
    segments)."""
    found: dict[str, set[int]] = {}
    for process in processes:
        for fd in os.listdir(f"/proc/{process.pid}/fd"):
            path = f"/proc/{process.pid}/fd/{fd}"
            try:
                target = os.readlink(path)
                mode = os.stat(path).st_mode & 0o777
            except OSError:
                continue
            if target.startswith("/memfd:tokstream-"):
                name = target.removeprefix("/memfd:").split(" ")[0]
                found.setdefault(name.rstrip("0123456789"), set()).add(mode)
    return found


@pytest.mark.startup
def test_a_sigkilled_gateway_leaves_nothing_and_its_files_are_owner_only(short_tmp):
    """Issue 31: the KV pool files, the block index and the all-reduce segments are memfds
    only their owner may open (made 0777, anyone let into /proc/PID/fd could read every
    block), the folders 0700; and a gateway SIGKILLed leaves no folder behind (its janitor
    removes the cores' folders, which hold every temporary file of the cores and ranks)."""
    tmp_path = short_tmp
    with ServerProcess("--profile", "ci", "--tp", "2", env={"TMPDIR": str(tmp_path)}) as server:
        gateway = psutil.Process(server.process.pid)
        tree = [gateway, *gateway.children(recursive=True)]
        modes = memory_files(tree)
        assert set(modes) == {"tokstream-kv-rank", "tokstream-kv-index",
                              "tokstream-allreduce"}, modes
        assert all(m == {0o600} for m in modes.values()), modes
        folders = [os.path.join(root, name) for root, dirs, _ in os.walk(tmp_path)
                   for name in dirs]
        assert folders and all(os.stat(f).st_mode & 0o777 == 0o700 for f in folders), folders
        # Everything lives in the core's folder (with its forkserver's socket folder).
        assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(rank_folders(
            tmp_path)[0])], list(tmp_path.iterdir())
        gateway.kill()
        alive = wait_ended(tree, 30)
        assert not alive, alive
    assert list(tmp_path.iterdir()) == []


@pytest.mark.startup
def test_a_rank_killed_while_loading_takes_its_group_and_folder_with_it(tmp_path):
    """The OOM killer taking one rank of a loading group: the group fails as a whole, its
    other rank and its rendezvous folder do not outlive it."""
    group = RankGroup(EngineConfig(model="dummy:tiny", tp=2), run_dir=str(tmp_path))
    group.processes[0].kill()
    with pytest.raises(ReplicaError, match="rank 0 .* died while loading"):
        group.wait_ready()
    assert group.alive() == [False, False]
    assert rank_folders(tmp_path) == []
