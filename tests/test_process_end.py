"""process_end: a process has ended once it is a zombie, without waiting for a reaper (these
VMs' init reaps an orphan ~1.7 s after its death)."""

import subprocess
import time

import psutil

from tokstream.process_end import running, wait_ended


def test_a_zombie_has_ended_and_a_live_process_has_not():
    live = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["sleep", "30"])
    try:
        dead.kill()
        zombie = psutil.Process(dead.pid)
        while zombie.status() != psutil.STATUS_ZOMBIE:  # not reaped: this process never waits
            time.sleep(0.01)
        assert not running(zombie)
        assert running(psutil.Process(live.pid))
        assert wait_ended([zombie], 30) == []
        assert wait_ended([psutil.Process(live.pid), zombie], 0.2) == [psutil.Process(live.pid)]
    finally:
        live.kill()
        live.wait()
        dead.wait()


def test_a_process_gone_has_ended():
    process = subprocess.Popen(["true"])
    handle = psutil.Process(process.pid)
    process.wait()
    assert not running(handle)
    assert wait_ended([handle], 30) == []
