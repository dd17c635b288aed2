"""What a server leaves behind: nothing. Every rank group's rendezvous folder goes, on
restarts and at shutdown; ranks (and the forkserver they are forked from) die with their
engine core (PR_SET_PDEATHSIG) and the gateway
kills the recorded rank pids of a core that died; a replacement core keeps the pool size."""

import dataclasses
import os
import signal
import time

import httpx
import psutil
import pytest

from helpers.serving import ServerProcess, anthropic_body, record
from tokstream.config import CacheConfig, EngineConfig
from tokstream.server.supervisor import replacement_config


pytestmark = pytest.mark.timeout(180)


def rank_folders(tmp) -> list[str]:
    """The engine cores' and rank groups' folders under tmp, at any depth."""
    return sorted(os.path.relpath(os.path.join(root, name), tmp)
                  for root, dirs, _ in os.walk(tmp) for name in dirs
                  if name.startswith(("tokstream-ranks-", "tokstream-core-")))


def wait_for(predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.startup
def test_no_rank_folder_or_process_outlives_restarts_and_shutdown(tmp_path):
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
        _, alive = psutil.wait_procs(first_ranks + below, timeout=30)
        assert not alive, alive
        response, _ = record(client, "/v1/messages", anthropic_body("hi", max_tokens=4))
        assert response.status_code == 200
        client.close()
        # The live core's, with its group's inside.
        assert len(rank_folders(tmp_path)) == 2, rank_folders(tmp_path)
        tree = [psutil.Process(server.process.pid)] + psutil.Process(
            server.process.pid).children(recursive=True)
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive
    assert rank_folders(tmp_path) == []


def test_a_replacement_core_keeps_the_pool_size():
    config = EngineConfig(model="dummy:tiny", cache=CacheConfig(kv_cache_memory=2**20))
    replaced = replacement_config(config, {"num_blocks": 321})
    assert replaced.cache.num_blocks == 321
    assert dataclasses.replace(replaced, cache=config.cache) == config
