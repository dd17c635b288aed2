"""Every socket between the ranks is on loopback (issue 31), even where /etc/hosts maps the
host's name to another address, as Kubernetes does for a pod: gloo binds the address the
host name resolves to unless told an interface. Run in a network namespace of its own
(unshare: root, or user namespaces) with such an /etc/hosts bind-mounted and a second
interface holding that address (192.0.2.2, TEST-NET-1: nothing is ever sent there)."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.startup, pytest.mark.timeout(240)]

TESTS = Path(__file__).parent
POD_ADDRESS = "192.0.2.2"


def namespace_command(hosts: Path) -> list[str]:
    setup = " && ".join([
        f"mount --bind {hosts} /etc/hosts",
        "ip link set lo up",
        "ip link add veth0 type veth peer name veth1",
        f"ip addr add {POD_ADDRESS}/24 dev veth0",
        "ip link set veth0 up", "ip link set veth1 up",
        f'test "$(getent hosts "$(hostname)" | cut -d" " -f1)" = {POD_ADDRESS}',
        f"exec {sys.executable} {TESTS / 'helpers' / 'rank_sockets.py'} {TESTS}"])
    return ["unshare", *([] if _is_root() else ["-r"]), "-nm", "sh", "-c", setup]


def _is_root() -> bool:
    import os
    return os.geteuid() == 0


def test_the_ranks_sockets_are_on_loopback_when_the_host_name_is_not(tmp_path):
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip")
    probe = subprocess.run(["unshare", *([] if _is_root() else ["-r"]), "-nm", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace here: {probe.stderr.decode()[:200]}")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{POD_ADDRESS} {socket.gethostname()}\n")
    result = subprocess.run(namespace_command(hosts), capture_output=True, text=True,
                            timeout=200, cwd=TESTS.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    ranks = set(found["ranks"])
    rank_sockets = [s for s in found["sockets"] if s["pid"] in ranks]
    assert any(s["status"] == "LISTEN" for s in rank_sockets), found  # gloo's own
    for s in found["sockets"]:
        assert s["local"] in ("127.0.0.1", "::1"), s
        assert s["remote"] in (None, "127.0.0.1", "::1"), s
