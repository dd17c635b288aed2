"""TEST ONLY: a demux that corrupts tokens, so tests and chaos runs can show the integrity
checker catches a lost, duplicated, reordered or misrouted token.

The production demux (tokstream.server.streaming.streams.StreamRegistry) only offers a hook,
`reroute`, that nothing in it sets; `install` plugs a mutation in, and only serve's hidden
--demux-mutation flag calls it (refused with tenants or a public bind, see ServerConfig).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokstream.engine.messages.request import RequestDelta

if TYPE_CHECKING:
    from tokstream.server.streaming.streams import Stream, StreamRegistry

log = logging.getLogger("tokstream.server")

MUTATIONS = ("drop", "repeat", "swap", "misroute")


def install(registry: StreamRegistry, kinds: str) -> DemuxMutation:
    """Make registry's demux corrupt tokens as kinds says (see DemuxMutation)."""
    mutation = DemuxMutation(kinds)
    registry.reroute = mutation
    log.warning("DEMUX MUTATION %r ENABLED: streams will be corrupted (tests only)", kinds)
    return mutation


class DemuxMutation:
    """Corrupts one token on its way from the engine to the channels, downstream of the
    engine's stamping: drop, repeat, swap or misroute (or a comma-separated sequence of them:
    each fires once, in turn); a mutation fires on a token at output index `at_index`."""

    def __init__(self, kinds: str, at_index: int = 2):
        self.kinds = [k.strip() for k in kinds.split(",") if k.strip()]
        for kind in self.kinds:
            if kind not in MUTATIONS:
                raise ValueError(f"demux_mutation must name mutations among "
                                 f"{', '.join(MUTATIONS)}, not {kind!r}")
        self.at_index = at_index
        self._held: RequestDelta | None = None
        self._spent: set[str] = set()
        """Requests live when a mutation fired: the next one waits for newer requests, so
        each run of a test sees one mutation."""
        self._streams: dict[str, Stream] = {}

    @property
    def kind(self) -> str | None:
        return self.kinds[0] if self.kinds else None

    @property
    def done(self) -> bool:
        return not self.kinds

    @done.setter
    def done(self, value: bool) -> None:
        if value:
            self.kinds.pop(0)  # this one fired; the next (if any) waits for its turn
            self._spent = set(self._streams)

    def __call__(self, delta: RequestDelta, streams: dict[str, Stream]):
        """[(stream, delta)] to deliver instead of delta to its own stream (the registry's
        reroute hook)."""
        own = streams[delta.request_id]
        if self.done:
            return [(own, delta)]
        self._streams = streams
        if delta.request_id in self._spent:
            return [(own, delta)]
        held = self._held
        if held is not None and held.request_id == delta.request_id:
            self._held = None
            if delta.finished:  # nothing to swap with: deliver in order, try again later
                return [(own, held), (own, delta)]
            self.done = True
            return [(own, delta), (own, held)]  # swapped
        if delta.finished or delta.first_index != self.at_index or len(delta.token_ids) != 1:
            return [(own, delta)]
        if self.kind == "drop":
            self.done = True
            return []
        if self.kind == "repeat":
            self.done = True
            return [(own, delta), (own, delta)]
        if self.kind == "swap":
            if held is None:
                self._held = delta
                return []
            return [(own, delta)]
        others = [s for s in streams.values() if s is not own and s.final is None]
        if not others:
            return [(own, delta)]
        self.done = True
        return [(others[0], delta)]  # misrouted: the other caller gets this token
