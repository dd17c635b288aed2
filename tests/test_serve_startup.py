"""How `tokstream serve` starts (server/startup.py): the engine core is launched before the
gateway imports its app, a bad port is refused before anything starts, and a gateway that
fails after the launch leaves no core, rank or folder behind."""

import json
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.startup

PROBE = """
import json, os, sys
import psutil
import tokstream.text.tokenizer
from tokstream.engine.async_engine import AsyncEngine
from tokstream.process_end import running

launched = []
launch = AsyncEngine.launch
def recorded(self):
    launched.append(("tokstream.server.app" in sys.modules, self))
    launch(self)
    launched.append(psutil.Process(self.process.pid))
    return self
AsyncEngine.launch = recorded
def broken(source):
    # by then the core's forkserver is up: its tree is what the gateway must clean up
    while not launched[1].children():
        pass
    launched.append(launched[1].children(recursive=True))
    raise RuntimeError("the tokenizer broke")
tokstream.text.tokenizer.load_tokenizer = broken
from tokstream.cli import main
sys.argv = ["tokstream", "serve", "--profile", "ci", "--port", "0"]
error = None
try:
    main()
except BaseException as exc:
    error = repr(exc)
(app_imported, engine), core, below = launched
print(json.dumps({"error": error, "app_imported": app_imported, "below": len(below),
                  "running": [p.pid for p in [core, *below] if running(p)],
                  "run_dir_left": os.path.exists(engine.run_dir)}))
"""


def test_the_core_is_launched_first_and_discarded_when_the_gateway_fails():
    # (A core left running would hold the interpreter's exit: the timeout fails it.)
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            timeout=60)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert "the tokenizer broke" in seen["error"], result.stderr[-2000:]
    assert seen["app_imported"] is False  # the gateway's imports overlap the core's start
    assert seen["below"] >= 1  # the forkserver (and maybe a rank) was there to clean up
    assert seen["running"] == [] and seen["run_dir_left"] is False, seen


def test_a_port_in_use_is_refused_before_any_core_starts():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    probe = ("import sys\nfrom tokstream.engine.async_engine import AsyncEngine\n"
             "def launch(self):\n    raise SystemExit('launched')\n"
             "AsyncEngine.launch = launch\nfrom tokstream.cli import main\n"
             f"sys.argv = ['tokstream', 'serve', '--profile', 'ci', '--port', '{port}']\n"
             "main()\n")
    with taken:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{port}" in result.stderr
    assert "launched" not in result.stderr
