"""Stored Responses API responses, for `previous_response_id` and GET / DELETE
/v1/responses/{id}: kept in the gateway's memory (not across its restarts), bounded in bytes,
each visible only to the tenant that made it.

When the bound is passed, the tenant holding the most bytes loses its oldest response first,
so one tenant storing a flood of long conversations evicts its own, not the others'."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    """The response object as it was returned (completed or incomplete)."""
    input_items: list[dict]
    """The conversation it answered, as items: the previous response's input and output
    items, then this request's input (each with an id)."""
    size: int
    """Bytes it is counted as (its JSON)."""

    @property
    def conversation(self) -> list[dict]:
        """What a request continuing from it starts with: its input, then its output."""
        return self.input_items + self.response["output"]


class ResponseStore:
    """Responses by owner and id, the oldest of the largest owner evicted past max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        """0: nothing is stored (a request's `store: true` is answered false)."""
        self._by_owner: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._owner_bytes: dict[str, int] = {}
        self.bytes = 0
        self._lock = threading.Lock()  # parsing reads it off the event loop

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, owner: str, response: dict, input_items: list[dict]) -> bool:
        """Keep the response (False when storing is off or it alone is past the bound)."""
        size = len(json.dumps([response, input_items], ensure_ascii=False).encode())
        if not self.enabled or size > self.max_bytes:
            return False
        with self._lock:
            self._by_owner.setdefault(owner, OrderedDict())[response["id"]] = StoredResponse(
                response, input_items, size)
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
            self.bytes += size
            while self.bytes > self.max_bytes:
                largest = max(self._owner_bytes, key=self._owner_bytes.get)
                self._remove(largest, next(iter(self._by_owner[largest])))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._by_owner.get(owner, {}).get(response_id)

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            if response_id not in self._by_owner.get(owner, {}):
                return False
            self._remove(owner, response_id)
            return True

    def count(self) -> int:
        with self._lock:
            return sum(len(responses) for responses in self._by_owner.values())

    def _remove(self, owner: str, response_id: str) -> None:
        stored = self._by_owner[owner].pop(response_id)
        self._owner_bytes[owner] -= stored.size
        self.bytes -= stored.size
        if not self._by_owner[owner]:
            del self._by_owner[owner], self._owner_bytes[owner]
