"""Which requests the engine core is computing right now, in memory the gateway can still read
after the core is dead.

When a core dies, the gateway charges the death to the requests it may have caused
(server/replica/recovery.py). Charging every live request blamed the innocent: three quick
deaths from a failing host ended streams that merely waited their turn (issue 31). The rank
path charges a failed step's own requests; this record lets the gateway do the same: the core
writes its step's request ids before it executes the step and clears them once it is back, so
a death between steps charges nobody, and one inside a step charges only that step's
requests. A suspect (a request on its last chance) then shares no step with another suspect
(Scheduler.suspect_after_failures), so the one that kills the core is found alone.

Layout: a sequence number (odd while the core writes), the payload's length, the payload
(request ids joined by newlines). A record the core died while writing, or one too long to
hold, reads as unknown, and the gateway falls back to charging every request the core held.
"""

from __future__ import annotations

import ctypes
import struct

RECORD_BYTES = 64 * 1024
_HEADER = struct.Struct("<QQ")
"""(sequence, payload length)."""
TOO_MANY = 2**64 - 1
"""The payload length that says: more ids than fit."""


def new_record(context) -> ctypes.Array:
    """The shared bytes (a multiprocessing RawArray), made by the gateway for one core."""
    return context.RawArray(ctypes.c_ubyte, RECORD_BYTES)


class StepRecord:
    """The core's end."""

    def __init__(self, shared: ctypes.Array):
        self._view = memoryview(shared).cast("B")
        self._sequence = 0

    def begin(self, request_ids: list[str]) -> None:
        payload = "\n".join(request_ids).encode()
        fits = _HEADER.size + len(payload) <= len(self._view)
        self._write(payload if fits else b"", len(payload) if fits else TOO_MANY)

    def end(self) -> None:
        self._write(b"", 0)

    def _write(self, payload: bytes, length: int) -> None:
        self._sequence += 1  # odd: being written
        _HEADER.pack_into(self._view, 0, self._sequence, 0)
        self._view[_HEADER.size:_HEADER.size + len(payload)] = payload
        self._sequence += 1
        _HEADER.pack_into(self._view, 0, self._sequence, length)


def in_flight(shared: ctypes.Array) -> set[str] | None:
    """The gateway's read, once the core is dead: the ids of the step it died in (empty: it
    died between steps), or None when the record cannot tell."""
    view = memoryview(shared).cast("B")
    sequence, length = _HEADER.unpack_from(view, 0)
    if sequence % 2 or length == TOO_MANY or _HEADER.size + length > len(view):
        return None
    payload = bytes(view[_HEADER.size:_HEADER.size + length]).decode(errors="replace")
    return set(payload.split("\n")) if payload else set()
