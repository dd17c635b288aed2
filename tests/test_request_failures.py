"""The gateway's recovery (server/replica/recovery.py) without processes (issue 31): its count
of engine-core deaths per request, driven by hand-built deaths and token deltas through a real
StreamRegistry. The
engine is a stand-in for the core process: it records what it was given, and a death is told
by the step record's answer (the ids of the step it died in, or None: cannot tell).

The race these pin down, seen in chaos rapid-core-deaths: a host kills each new core
0.2-0.35 s after it serves again. Two streams that were re-prefilling at the second death
(no token from that core) are suspects at the third core; the first was given to it ~50 ms
after the others' first tokens, was in the step the host killed, and was ended as a poison
request for deaths it did not cause."""

import asyncio

from tokstream.engine.messages.request import RequestDelta
from tokstream.errors import ErrorKind
from tokstream.sampling_params import SamplingParams
from tokstream.server.replica import recovery
from tokstream.server.replica.recovery import ReplicaRecovery
from tokstream.server.streaming.streams import StreamRegistry

NAMES = ("a", "b", "c", "d")
HOST_KILL_LAG_S = 0.3
"""When the failing host kills a core after its first tokens (the chaos run's lag)."""


class CoreStandIn:
    """What the registry and ReplicaRecovery ask of an AsyncEngine: it takes requests and
    remembers them; dead is set when the test kills it."""

    def __init__(self):
        self.given: list[str] = []
        self.dead: str | None = None

    def add_request(self, request, sink) -> None:
        self.given.append(request.request_id)

    def forget(self, request_id: str) -> None:
        pass

    def die(self) -> None:
        self.dead = "SIGKILL"


def token(registry: StreamRegistry, name: str) -> None:
    stream = registry.streams[name]
    n = len(stream.delivered)
    registry.deliver(RequestDelta(name, [5], n, "x", num_output_tokens=n + 1))


def two_suspects_on_a_third_core():
    """Deaths 1 and 2 of the chaos run: all four in flight at the first; at the second, a and b
    had a token from the new core, c and d were still re-prefilling. Returns the registry, the
    failures, the ended request ids and the third core (given a and b, c and d held)."""
    ended = []
    first = CoreStandIn()
    registry = StreamRegistry(first)
    failures = ReplicaRecovery(registry, 3, 3, lambda kind, request_id, failures: ended.append(
        request_id))
    for name in NAMES:
        registry.open(name, [1, 2, 3], SamplingParams(max_tokens=100), None, "completions")
        token(registry, name)
    first.die()
    assert failures.count_death(set(NAMES)) == 0
    second = CoreStandIn()
    failures.resubmit(second)
    token(registry, "a")
    token(registry, "b")
    second.die()
    assert failures.count_death(set(NAMES)) == 0
    assert [failures.failures(registry.streams[n]) for n in NAMES] == [1, 1, 2, 2]
    third = CoreStandIn()
    failures.resubmit(third)
    assert third.given == ["a", "b"] and [s.request_id for s in failures.held] == ["c", "d"]
    return registry, failures, ended, third


def test_a_host_that_kills_each_core_as_it_serves_ends_no_suspect():
    async def run():
        registry, failures, ended, third = two_suspects_on_a_third_core()
        token(registry, "a")
        token(registry, "b")
        await asyncio.sleep(HOST_KILL_LAG_S)
        third.die()  # computing what it was given
        assert failures.count_death(set(third.given)) == 0, f"ended for the host: {ended}"
        assert third.given == ["a", "b"], "a suspect was given to the core before its grace"
        # No suspect was in the step: the deaths were the host's, not theirs.
        assert [failures.failures(registry.streams[n]) for n in NAMES] == [1, 1, 0, 0]
        fourth = CoreStandIn()
        failures.resubmit(fourth)
        assert fourth.given == list(NAMES) and not failures.held
        failures.close()

    asyncio.run(run())


def test_held_suspects_are_not_charged_when_the_step_record_cannot_tell():
    async def run():
        registry, failures, ended, third = two_suspects_on_a_third_core()
        third.die()  # before any token, the record unreadable: charge what it was given
        assert failures.count_death(None) == 0
        assert not ended
        assert [failures.failures(registry.streams[n]) for n in NAMES] == [2, 2, 2, 2]
        failures.close()

    asyncio.run(run())


def test_a_suspect_that_kills_the_core_once_given_is_ended(monkeypatch):
    """The grace delays a poison request's last trial; it does not excuse it."""
    monkeypatch.setattr(recovery, "SUSPECT_GRACE_S", 0.05, raising=False)

    async def run():
        registry, failures, ended, third = two_suspects_on_a_third_core()
        token(registry, "a")
        token(registry, "b")
        for _ in range(200):
            if "c" in third.given:
                break
            await asyncio.sleep(0.01)
        assert third.given == ["a", "b", "c"], "the first suspect alone, the next held"
        third.die()  # in the step that computed c
        assert failures.count_death({"a", "b", "c"}) == 1
        assert ended == ["c"] and registry.streams["c"].final.error_kind == ErrorKind.USER
        # d was not given to that core: still a suspect, not charged.
        assert failures.failures(registry.streams["d"]) == 2
        failures.close()

    asyncio.run(run())
