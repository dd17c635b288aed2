"""Environment switches are read in one module (tokstream/envs.py): anywhere else a read of
os.environ is one of the few places below that set or hand on variables, not read switches."""

import re
from pathlib import Path

from tokstream import envs

ROOT = Path(__file__).resolve().parents[1]
READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]+\](?!\s*=)")
NOT_SWITCHES = {
    "tokstream/engine/rank_start.py",  # sets the workers' malloc variables, then restores them
    "tokstream/engine/forkserver_guard.py",  # the forkserver's start handshake
}


def test_no_module_but_envs_reads_an_environment_switch():
    readers = {str(path.relative_to(ROOT))
               for folder in ("tokstream", "kernels", "loadgen", "chaos")
               for path in (ROOT / folder).rglob("*.py")
               if READ.search(path.read_text(encoding="utf-8"))}
    assert readers - NOT_SWITCHES == {"tokstream/envs.py"}


def test_switches_read_their_defaults_and_the_environment(monkeypatch, tmp_path):
    assert len({s.name for s in envs.SWITCHES}) == len(envs.SWITCHES)
    monkeypatch.delenv("TOKSTREAM_KERNELS", raising=False)
    assert envs.KERNELS.get() == "auto"
    monkeypatch.setenv("TOKSTREAM_KERNELS", "torch")
    assert envs.KERNELS.get() == "torch"  # read when asked, never cached
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.cache_root() == tmp_path
    monkeypatch.setenv("TOKSTREAM_SELF_CHECK", "")
    assert not envs.SELF_CHECK.is_set()
