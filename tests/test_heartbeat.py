"""The engine core's heartbeat watch (engine/heartbeat.py), on a fake clock: a counter that
stops moving is hung past the limit; a gateway that was itself busy is not fooled."""

import multiprocessing as mp
import time

from tokstream.engine.heartbeat import (MAX_SILENCE_S, HeartbeatWatch, silence_limit_s,
                                        start_beating)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_counter_that_stops_is_hung_past_the_limit():
    counter, clock = mp.get_context("spawn").RawValue("Q", 0), Clock()
    watch = HeartbeatWatch(counter, 2.0, clock)
    for _ in range(10):  # beating: never hung, however long it runs
        clock.now += 1.5
        counter.value += 1
        assert not watch.hung
    clock.now += 1.9
    assert not watch.hung
    clock.now += 0.2
    assert watch.hung and watch.silent_s() > 2.0
    counter.value += 1  # beats again: counted from now
    assert not watch.hung


def test_a_busy_gateway_is_not_a_silent_core():
    """The gateway looks only now and then (its loop was busy for 30 s); the counter moved
    meanwhile, so the core is not hung."""
    counter, clock = mp.get_context("spawn").RawValue("Q", 0), Clock()
    watch = HeartbeatWatch(counter, 2.0, clock)
    counter.value += 120
    clock.now += 30
    assert not watch.hung


def test_the_limit_follows_the_step_deadline_within_bounds():
    assert silence_limit_s(5) == 5
    assert silence_limit_s(120) == MAX_SILENCE_S
    assert silence_limit_s(0.1) == 1.0


def test_the_beating_thread_moves_the_counter():
    counter = mp.get_context("spawn").RawValue("Q", 0)
    start_beating(counter)
    deadline = time.monotonic() + 10
    while counter.value < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
