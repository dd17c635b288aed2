"""An idle engine core reads a burst of arrivals before its first step, so the burst shares
it (SchedulerConfig.arrival_gather_ms); a stream of arrivals that never pauses does not hold
the step back past the limit. A stand-in core over a real pipe, no model."""

import multiprocessing as mp
import threading
import time

import pytest

from tokstream.config import SchedulerConfig
from tokstream.engine import core_process
from tokstream.engine.messages.gateway import Add, Shutdown
from tokstream.engine.messages.request import EngineRequest
from tokstream.errors import UserInputError
from tokstream.sampling_params import SamplingParams


class CountingCore:
    """Records how many requests had arrived at each step; one step, then it asks to stop."""

    def __init__(self, gateway):
        self.gateway, self.added, self.seen_at_steps = gateway, [], []
        self.status, self.pending_deltas = "ready", []

    @property
    def has_work(self) -> bool:
        return bool(self.added) and not self.seen_at_steps

    def add_request(self, request):
        self.added.append(request.request_id)

    def step(self):
        self.seen_at_steps.append(len(self.added))
        self.gateway.send(Shutdown())
        return []


def run(count: int, spacing_s: float, gather_s: float) -> tuple[int, int]:
    """(requests the first step saw, requests sent in all): count adds spacing_s apart."""
    gateway, core_end = mp.Pipe()
    core = CountingCore(gateway)
    sent = []

    def send():
        for i in range(count):
            if core.seen_at_steps:
                break
            gateway.send(Add(EngineRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4))))
            sent.append(i)
            time.sleep(spacing_s)

    sender = threading.Thread(target=send)
    sender.start()
    core_process._serve(core_end, core, gather_s)
    sender.join()
    return core.seen_at_steps[0], len(sent)


def test_a_burst_of_arrivals_shares_the_first_step():
    # Windows far wider than the spacing, so a busy machine cannot split the burst.
    first, sent = run(count=6, spacing_s=0.005, gather_s=0.25)
    assert (first, sent) == (6, 6)


def test_arrivals_that_never_pause_do_not_hold_the_first_step_past_the_limit():
    # 400 adds 5 ms apart (2 s) against a 50 ms window: the step starts after at most
    # GATHER_LIMIT windows (0.25 s), with far fewer than all of them.
    first, sent = run(count=400, spacing_s=0.005, gather_s=0.05)
    assert 1 <= first < 200 and sent < 400


def test_a_negative_window_is_refused():
    with pytest.raises(UserInputError, match="arrival_gather_ms"):
        SchedulerConfig(arrival_gather_ms=-1)
