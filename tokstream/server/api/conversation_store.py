"""Conversations kept between requests, for the Responses API (`previous_response_id`, GET
and DELETE /v1/responses/{id}) and the Messages API's threads (`thread`, beta): in the
gateway's memory (not across its restarts), bounded in bytes, each visible only to the tenant
that made it. What a record holds is its API's business; this keeps, finds and forgets them.

When the bound is passed, the tenant holding the most bytes loses its oldest record first,
so one tenant storing a flood of long conversations evicts its own, not the others'."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


def json_size(value) -> int:
    """Bytes of value's JSON: what a record is counted as. ~7 ms a MB: measure a request's
    conversation where the request is parsed, off the event loop, and only the reply at the
    end."""
    return len(json.dumps(value, ensure_ascii=False).encode())


def owner_of(tenant) -> str:
    """Whose records a caller sees: its tenant's (everyone's on an open server)."""
    return tenant.name if tenant is not None else ""


@dataclass(frozen=True)
class Kept:
    record: dict
    size: int
    """Bytes it is counted as (its JSON)."""


class ConversationStore:
    """Records by owner and id, the oldest of the largest owner evicted past max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        """0: nothing is kept."""
        self._by_owner: dict[str, OrderedDict[str, Kept]] = {}
        self._owner_bytes: dict[str, int] = {}
        self.bytes = 0
        self._lock = threading.Lock()  # requests are parsed off the event loop
        self.on_evict: Callable[[str, str, dict], None] | None = None
        """Told (owner, key, record) of each record evicted past the bound (a Message Batch
        kept on disk goes from there too)."""

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, owner: str, key: str, record: dict, size: int | None = None) -> bool:
        """Keep the record, counted as size bytes (default: json_size(record)); False when
        storing is off or it alone is past the bound."""
        size = json_size(record) if size is None else size
        if not self.enabled or size > self.max_bytes:
            return False
        with self._lock:
            self._by_owner.setdefault(owner, OrderedDict())[key] = Kept(record, size)
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
            self.bytes += size
            while self.bytes > self.max_bytes:
                largest = max(self._owner_bytes, key=self._owner_bytes.get)
                oldest = next(iter(self._by_owner[largest]))
                evicted = self._by_owner[largest][oldest].record
                self._remove(largest, oldest)
                if self.on_evict is not None:
                    self.on_evict(largest, oldest, evicted)
        return True

    def get(self, owner: str, key: str) -> dict | None:
        with self._lock:
            kept = self._by_owner.get(owner, {}).get(key)
            return None if kept is None else kept.record

    def delete(self, owner: str, key: str) -> bool:
        with self._lock:
            if key not in self._by_owner.get(owner, {}):
                return False
            self._remove(owner, key)
            return True

    def records(self, owner: str) -> list[dict]:
        """The owner's records, oldest first."""
        with self._lock:
            return [kept.record for kept in self._by_owner.get(owner, {}).values()]

    def count(self) -> int:
        with self._lock:
            return sum(len(records) for records in self._by_owner.values())

    def _remove(self, owner: str, key: str) -> None:
        kept = self._by_owner[owner].pop(key)
        self._owner_bytes[owner] -= kept.size
        self.bytes -= kept.size
        if not self._by_owner[owner]:
            del self._by_owner[owner], self._owner_bytes[owner]
