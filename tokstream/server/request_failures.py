"""A request that keeps killing engine cores is ended, not resubmitted forever.

Each live request submitted to a core that died failed once more, unless it got a token since
its last failure. One in flight at `max_request_failures` deaths in a row is ended with an
error (the user's: it is what kills the cores); the others carry their count to the next core,
which runs a request on its last chance in a step of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from tokstream.engine.messages import FinishReason, RequestDelta, poison_message
from tokstream.errors import ErrorKind
from tokstream.server.streams import StreamRegistry


class RequestFailures:
    def __init__(self, registry: StreamRegistry, limit: int,
                 on_event: Callable[..., None]):
        self.registry = registry
        self.limit = limit
        """EngineConfig.max_request_failures."""
        self.on_event = on_event
        """Called with ("request_failed", request_id=..., failures=...) for each one ended."""
        self._deaths: dict[str, tuple[int, int]] = {}
        """request id -> (core deaths in a row it was in flight at, tokens it had then)."""

    def count_death(self) -> int:
        """The current core died: count it against each live request it held, end those at
        the limit. Returns how many were ended."""
        counts = {}
        ended = 0
        for stream in self.registry.streams.values():
            if not stream.live or not stream.submissions:
                continue
            failures, tokens = self._deaths.get(stream.request_id, (0, -1))
            failures = failures + 1 if tokens == len(stream.delivered) else 1
            counts[stream.request_id] = (failures, len(stream.delivered))
            stream.engine_fields["num_failures"] = failures
            if failures >= self.limit:
                ended += 1
                self.on_event("request_failed", request_id=stream.request_id,
                              failures=failures)
                n = len(stream.delivered)
                self.registry._deliver(RequestDelta(
                    stream.request_id, [], n, "", finish_reason=FinishReason.ERROR,
                    error=poison_message(failures, "its process died"), error_kind=ErrorKind.USER,
                    num_prompt_tokens=stream.num_prompt_tokens, num_output_tokens=n))
        self._deaths = counts
        return ended
