"""Ranks fork from their process's forkserver (rank_start), which an earlier engine may have
started with the environment of its time: a rank still runs with the environment in force
when its group starts (here a bad TOKSTREAM_KERNELS, which the rank reads as it loads)."""

import pytest

from tokstream.config import EngineConfig
from tokstream.engine.llm import LLM
from tokstream.errors import TokstreamError

pytestmark = pytest.mark.startup

CONFIG = EngineConfig(model="dummy:tiny", dtype="float32", device="cpu")


def test_a_rank_takes_the_environment_its_group_starts_with(monkeypatch):
    with LLM(CONFIG) as llm:  # the forkserver runs from here on, started without the variable
        assert llm.core.executor.ready.kernels == "torch"
    monkeypatch.setenv("TOKSTREAM_KERNELS", "no-such-kernels")
    with pytest.raises(TokstreamError, match="TOKSTREAM_KERNELS"):
        LLM(CONFIG)
