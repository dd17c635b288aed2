"""Session-wide test set-up: Triton's interpreter for the kernel tests on machines without a GPU.

The interpreter (TRITON_INTERPRET=1) must be on when triton is first imported: triton's own
library functions (tl.sum, tl.max, ...) are decorated then, and transformers imports triton as
soon as a test imports it. So, without a GPU, triton is imported here under the interpreter and
the variable is unset again at once, so that no other test or child process sees it;
tests/triton_interpreter.py turns it back on while the kernel tests run.
"""

import importlib.util
import os

import pytest


def _import_triton_for_the_interpreter() -> None:
    if importlib.util.find_spec("triton") is None:
        return
    import torch

    if torch.cuda.is_available():
        return  # compiled kernels: tests/test_triton_kernels_gpu.py
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_the_interpreter()


# `make test-fast` (-m "not startup") runs only tests that start no server, engine core, rank
# group or model. A test that does so without the `startup` mark fails there at once, instead of
# quietly making the fast run slow: the mark stays true by itself.
STARTING_COMMANDS = {"serve", "generate", "bench", "chaos"}


def _starts_model(*_args, **_kwargs):
    import pytest

    pytest.fail("this test starts a server, an engine or a model: mark it "
                "@pytest.mark.startup (make test-fast leaves such tests out)", pytrace=False)


def pytest_configure(config):
    if "not startup" not in (config.getoption("markexpr", "") or ""):
        return
    import subprocess

    from tokstream.engine.async_engine import AsyncEngine
    from tokstream.engine.executor import RankGroup
    from tokstream.serve_process import ServeProcess

    ServeProcess.start = _starts_model
    RankGroup.__init__ = _starts_model
    AsyncEngine.launch = AsyncEngine.start = _starts_model
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *rest, **kwargs):
        words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
        tail = words[words.index("tokstream") + 1:] if "tokstream" in words else [
            w for i, w in enumerate(words[1:]) if words[i].endswith("/tokstream")][:1]
        if tail and tail[0] in STARTING_COMMANDS and "--help" not in words:
            _starts_model()
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded_popen


@pytest.fixture(scope="session")
def shared_servers():
    """The servers helpers.serving.module_server shares between test files, by their
    arguments; each stopped as the session ends."""
    servers: dict = {}
    yield servers
    for server in servers.values():
        server.stop()
