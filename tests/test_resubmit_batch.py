"""A new engine core gets every resumed request before its first step: the gateway sends them
as one batch message (AsyncEngine.batch), and the core acts on a whole batch before it steps.
Sent one by one, a core that had read only the first would re-prefill the others in later
steps, each resumed stream waiting one more step for its next token."""

import multiprocessing as mp

from tokstream.config import EngineConfig
from tokstream.engine import core_process
from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.core_pipe import CorePipe
from tokstream.engine.messages.gateway import Abort, Add, Batch, Shutdown
from tokstream.engine.messages.request import EngineRequest
from tokstream.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def test_messages_sent_in_a_batch_reach_the_pipe_as_one():
    engine = AsyncEngine(EngineConfig(model="dummy:tiny"))
    gateway_end, core_end = mp.Pipe()
    engine._pipe = CorePipe(gateway_end)
    engine._pipe.start_sender()
    with engine.batch():
        for i in range(3):
            engine.add_request(EngineRequest(f"r{i}", [5, 6, 7], PARAMS), lambda delta: None)
    engine.abort("r0")  # after the batch: a message of its own
    batch = core_end.recv()
    assert isinstance(batch, Batch)
    assert [type(m) for m in batch.messages] == [Add, Add, Add]
    assert [m.request.request_id for m in batch.messages] == ["r0", "r1", "r2"]
    assert core_end.recv() == Abort("r0")
    engine._pipe.close()


class StepRecorder:
    """Just enough of an engine core for core_process._serve: it records which requests it
    holds at each step, and asks for the shutdown after the first."""

    def __init__(self, client_end):
        self.client_end = client_end
        self.added: list[str] = []
        self.steps: list[list[str]] = []
        self.status = "ready"
        self.pending_deltas = []

    @property
    def has_work(self) -> bool:
        return bool(self.added)

    def add_request(self, request: EngineRequest) -> None:
        self.added.append(request.request_id)

    def step(self):
        self.steps.append(list(self.added))
        self.client_end.send(Shutdown())
        return []


def test_the_core_takes_a_whole_batch_before_its_next_step():
    client_end, core_end = mp.Pipe()
    core = StepRecorder(client_end)
    client_end.send(Batch([Add(EngineRequest(f"r{i}", [5, 6, 7], PARAMS)) for i in range(3)]))
    core_process._serve(core_end, core)
    assert core.steps == [["r0", "r1", "r2"]]
