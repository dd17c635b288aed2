"""The gateway <-> engine core protocol (tokstream.engine.messages.gateway): every message
crosses a real pipe intact, each end acts on each message by its class, and a message of a
type it does not know is a ProtocolError on both ends, never silently dropped. No engine
starts: the core's loop runs against a stand-in core, the gateway's AsyncEngine against a
stand-in core thread on the far end of the pipe."""

import asyncio
import multiprocessing as mp
import os
import threading
import typing

import pytest

from tokstream.config import EngineConfig
from tokstream.engine import core_process
from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.core_pipe import CorePipe
from tokstream.engine.messages.gateway import (Abort, Add, AdoptPool, ArmSpare, Batch, CoreDead,
                                               CoreMessage, Deltas, GatewayMessage, PoolAdopted,
                                               ProtocolError, Ready, ScoreQuery, ScoreReply,
                                               Shutdown, StartFailed, StateQuery, StateReply,
                                               StatusChanged)
from tokstream.engine.messages.request import EngineRequest, RequestDelta
from tokstream.engine.messages.start_times import StartTimes
from tokstream.engine.messages.worker import ScoreResult
from tokstream.errors import (ErrorKind, OverloadedError, ReplicaError, UserInputError)
from tokstream.sampling_params import SamplingParams
from tokstream.state_snapshot import ReplicaStatus

pytestmark = pytest.mark.timeout(30)  # a reply that never comes fails, not hangs

REQUEST = EngineRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
DELTA = RequestDelta("r1", [9], 0, "x", num_prompt_tokens=3, num_output_tokens=1, step_id=2)
SAMPLES = [
    Add(REQUEST), Abort("r1"), ArmSpare(), StateQuery(3), ScoreQuery(4, [1, 2, 3], 1),
    AdoptPool(6), Shutdown(), Batch([Add(REQUEST), Abort("r1")]),
    Ready(start_times=StartTimes(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 2.1), model="m",
          dtype="float32", weights="native", pid=1, worker_pids=[2, 3], num_blocks=64,
          block_size=16, max_model_len=2048, vocab_size=100, capacity="64 blocks"),
    StartFailed(ErrorKind.USER, "no such model"), Deltas([DELTA]),
    StateReply(3, {"batch": {"running": 1}}),
    ScoreReply(4, ScoreResult([1.0], [2.0], [7])),
    ScoreReply(5, None, ErrorKind.OVERLOADED, "no room"),
    PoolAdopted(6, 12), PoolAdopted(7, 0, "the ranks' KV pools are their own"),
    StatusChanged(ReplicaStatus.RECOVERING, "rank 1 died", restarts=1, worker_pids=[4],
                  resumed_requests=2, recoveries=0, recovery_s=None),
    CoreDead("rank group gone"),
]


class Unknown:
    """A message neither end knows (picklable: it crosses the pipe, then is refused)."""


def test_every_message_class_has_a_sample():
    classes = set(typing.get_args(GatewayMessage)) | set(typing.get_args(CoreMessage))
    assert {type(m) for m in SAMPLES} == classes


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_a_real_pipe_intact(message):
    a, b = mp.Pipe()
    a.send(message)
    received = b.recv()
    assert type(received) is type(message) and received == message
    a.close(), b.close()


# --- the core's end --------------------------------------------------------------------------

class StandInCore:
    """Just enough of an EngineCore for core_process._serve: records what it was asked."""

    def __init__(self):
        self.added, self.aborted, self.armed = [], [], 0
        self.status, self.pending_deltas, self.has_work = "ready", [], False
        self.executor = self.recovery = self
        self.score_error: Exception | None = None
        self.gateway = None
        """The pipe's other end: asked to shut the loop down once it has read everything."""

    def add_request(self, request):
        if request.request_id == "refused":
            raise OverloadedError("queue full")
        self.added.append(request.request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)
        return RequestDelta(request_id, [], 0, "", finish_reason="abort")

    def adopt_pool(self):
        return len(self.added), None

    def arm_spare(self):
        self.armed += 1

    def reload_spare(self):  # the loop's idle turn, after its first read
        self.gateway.send(Shutdown())

    def snapshot(self):
        return {"batch": {"running": len(self.added)}}

    def score(self, token_ids, start):
        if self.score_error is not None:
            raise self.score_error
        return ScoreResult([float(t) for t in token_ids[start:]], [0.0], [0])


def serve(core, *messages):
    """Run the core's loop on messages (a Shutdown once it has read them); what it sent
    back."""
    gateway, core_end = mp.Pipe()
    core.gateway = gateway
    for message in messages:
        gateway.send(message)
    core_process._serve(core_end, core)
    replies = []
    while gateway.poll(0):
        replies.append(gateway.recv())
    return replies


def test_the_core_acts_on_each_message_by_its_class():
    core = StandInCore()
    replies = serve(core, Add(REQUEST), Add(EngineRequest("refused", [1], REQUEST.params)),
                    ArmSpare(), StateQuery(7), ScoreQuery(8, [1, 2, 3], 1), AdoptPool(9),
                    Abort("r1"))
    assert core.added == ["r1"] and core.armed == 1 and core.aborted == ["r1"]
    assert replies[0] == StateReply(7, {"batch": {"running": 1}})
    assert replies[1] == ScoreReply(8, ScoreResult([2.0, 3.0], [0.0], [0]))
    assert replies[2] == PoolAdopted(9, 1, None)
    (deltas,) = replies[3:]  # the refused add's error and the abort's end, after the read
    assert [(d.request_id, d.finish_reason, d.error_kind) for d in deltas.deltas] == [
        ("refused", "error", ErrorKind.OVERLOADED), ("r1", "abort", None)]


@pytest.mark.parametrize("error, kind", [(UserInputError("bad ids"), ErrorKind.USER),
                                         (OverloadedError("full"), ErrorKind.OVERLOADED)])
def test_a_failed_score_replies_with_its_kind(error, kind):
    core = StandInCore()
    core.score_error = error
    assert serve(core, ScoreQuery(1, [1, 2], 1)) == [ScoreReply(1, None, kind, str(error))]


@pytest.mark.parametrize("message", [Unknown(), ("add", REQUEST), Batch([Batch([])]),
                                     Deltas([])], ids=["object", "tuple", "nested", "reply"])
def test_the_core_refuses_a_message_it_does_not_know(message):
    with pytest.raises(ProtocolError, match="engine core got a message it does not know"):
        serve(StandInCore(), message)
    # core_main answers a ReplicaError with every live request's error and a CoreDead.
    assert issubclass(ProtocolError, ReplicaError)


# --- the gateway's end -----------------------------------------------------------------------

def stand_in_core(conn, unknown: bool = False):
    """The far end of the gateway's pipe: answers queries until the Shutdown."""
    while True:
        match conn.recv():
            case Shutdown():
                conn.close()
                return
            case Add(request):
                conn.send(Deltas([RequestDelta(request.request_id, [9], 0, "x"),
                                  RequestDelta(request.request_id, [], 1, "",
                                               finish_reason="stop")]))
                if unknown:
                    conn.send(Unknown())
            case StateQuery(token):
                conn.send(StatusChanged(ReplicaStatus.RECOVERING, "rank died", restarts=1,
                                        worker_pids=[os.getpid()], resumed_requests=2,
                                        recoveries=0, recovery_s=None))
                conn.send(StateReply(token, {"ok": True}))
            case AdoptPool(token):
                conn.send(PoolAdopted(token, 5))
            case ScoreQuery(token, token_ids, _) if token_ids == [0]:
                conn.send(ScoreReply(token, None, ErrorKind.USER, "bad ids"))
            case ScoreQuery(token, _, _):
                conn.send(ScoreReply(token, None, ErrorKind.REPLICA, "pass failed"))


async def gateway(unknown: bool = False):
    """An AsyncEngine wired to stand_in_core (what start() does once the core is ready)."""
    engine = AsyncEngine(EngineConfig(model="dummy:tiny"))
    engine._loop = asyncio.get_running_loop()
    gateway_end, core_end = mp.Pipe()
    engine._pipe = CorePipe(gateway_end)
    engine._pipe.start_reader(engine._loop, engine._dispatch)
    engine._pipe.start_sender()
    core = threading.Thread(target=stand_in_core, args=(core_end, unknown), daemon=True)
    core.start()
    return engine, core


def test_the_gateway_acts_on_each_message_by_its_class():
    async def main():
        engine, core = await gateway()
        statuses = []
        engine.on_status = lambda status, reason: statuses.append((status, reason))
        deltas = [delta async for delta in engine.generate(REQUEST)]
        assert [(d.token_ids, d.finish_reason) for d in deltas] == [([9], None), ([], "stop")]
        assert await engine.state() == {"ok": True}
        assert statuses == [(ReplicaStatus.RECOVERING, "rank died")]
        assert engine.replica_status is ReplicaStatus.RECOVERING
        assert (engine.restarts, engine.resumed_requests) == (1, 2)
        assert (await engine.adopt_pool()).blocks == 5
        with pytest.raises(UserInputError, match="bad ids"):
            await engine.score([0])
        with pytest.raises(ReplicaError, match="pass failed"):
            await engine.score([1, 2])
        engine._pipe.send(Shutdown())
        await asyncio.to_thread(core.join, 5)
        await asyncio.sleep(0.2)  # the reader sees the pipe close: a CoreDead of its own
        assert engine.dead == "engine core process exited"
        with pytest.raises(ReplicaError, match="engine is down"):
            await engine.state()

    asyncio.run(main())


def test_the_gateway_refuses_a_message_it_does_not_know():
    engine = AsyncEngine(EngineConfig(model="dummy:tiny"))
    for message in (Unknown(), ("deltas", [DELTA]), Add(REQUEST)):
        with pytest.raises(ProtocolError, match="gateway got a message it does not know"):
            engine._dispatch(message)


def test_an_unknown_message_from_the_pipe_is_raised_on_the_event_loop():
    async def main():
        raised = []
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: raised.append(context.get("exception")))
        engine, core = await gateway(unknown=True)
        deltas = [delta async for delta in engine.generate(REQUEST)]
        await asyncio.sleep(0.2)
        engine._pipe.send(Shutdown())
        await asyncio.to_thread(core.join, 5)
        return deltas, raised

    deltas, raised = asyncio.run(main())
    assert deltas[-1].finish_reason == "stop"
    assert [type(e) for e in raised] == [ProtocolError], raised
