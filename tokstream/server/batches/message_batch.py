"""A Message Batch: the requests it was given, each one's result once it has one, and the
object and results file the Messages API shows for it. Pure bookkeeping: batch_runner.py runs
the requests, batch_routes.py speaks HTTP."""

from __future__ import annotations

import datetime
import json
import re
import time
from dataclasses import dataclass, field

from tokstream.server.api_errors import bad_request
from tokstream.server.validation import _kind, shown

MAX_REQUESTS = 100_000
"""Requests one batch may hold (the API's limit; the body size bounds it first)."""
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""What a custom_id may be (the API's pattern)."""
EXPIRY_S = 24 * 3600
"""A batch's requests not run within this long of its creation end as expired."""
RESULT_TYPES = ("succeeded", "errored", "canceled", "expired")


def rfc3339(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class BatchItem:
    """One request of a batch."""

    custom_id: str
    params: dict
    """A Messages API request body, checked only when it runs (a bad one is an errored
    result, not a refused batch, as the API does)."""
    result: dict | None = None
    """{"type": "succeeded", "message": ...}, {"type": "errored", "error": ...},
    {"type": "canceled"} or {"type": "expired"}; None while it is processing."""


@dataclass
class MessageBatch:
    id: str
    owner: str
    """The tenant that made it (conversation_store.owner_of): no other sees it."""
    items: list[BatchItem]
    created_at: float = field(default_factory=time.time)
    cancel_initiated_at: float | None = None
    ended_at: float | None = None
    counts: dict[str, int] = field(default_factory=dict, init=False)
    """Requests by state, kept as results come in (/metrics reads them often)."""

    def __post_init__(self):
        self.counts = dict.fromkeys(("processing",) + RESULT_TYPES, 0)
        for item in self.items:
            self.counts[item.result["type"] if item.result is not None else "processing"] += 1

    def record(self, item: BatchItem, result: dict) -> None:
        """item's result, once."""
        assert item.result is None, item.custom_id
        item.result = result
        self.counts["processing"] -= 1
        self.counts[result["type"]] += 1

    @property
    def processing_status(self) -> str:
        if self.ended_at is not None:
            return "ended"
        return "canceling" if self.cancel_initiated_at is not None else "in_progress"

    @property
    def expires_at(self) -> float:
        return self.created_at + EXPIRY_S

    def request_counts(self) -> dict[str, int]:
        """Live counts (the API moves requests out of `processing` only at the end; here
        each moves when its own result is in, so progress shows), always summing to the
        batch's size."""
        return dict(self.counts)

    def settle_the_rest(self, result_type: str) -> list[tuple[int, dict]]:
        """Every request still without a result gets {"type": result_type}, and the batch
        ends; returns those (index, result)."""
        settled = []
        for index, item in enumerate(self.items):
            if item.result is None:
                self.record(item, {"type": result_type})
                settled.append((index, item.result))
        self.ended_at = time.time()
        return settled

    def body(self, results_url: str) -> dict:
        """The MessageBatch object; results_url only once it has ended."""
        return {"id": self.id, "type": "message_batch",
                "processing_status": self.processing_status,
                "request_counts": self.request_counts(),
                "created_at": rfc3339(self.created_at), "expires_at": rfc3339(self.expires_at),
                "ended_at": rfc3339(self.ended_at), "archived_at": None,
                "cancel_initiated_at": rfc3339(self.cancel_initiated_at),
                "results_url": results_url if self.ended_at is not None else None}

    def results_jsonl(self) -> bytes:
        """The results file: one {"custom_id", "result"} line per request, in request
        order."""
        return b"".join(json.dumps({"custom_id": item.custom_id, "result": item.result},
                                   ensure_ascii=False).encode() + b"\n" for item in self.items)

    def size(self) -> int:
        """Bytes it is kept as once ended (its results file)."""
        return len(self.results_jsonl())


def batch_items(body: dict) -> list[BatchItem]:
    """The requests of a POST /v1/messages/batches body; a 400 naming the first bad one."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise bad_request("requests", "must be a non-empty array of {custom_id, params} "
                                      f"objects, not {_kind(requests)}")
    if len(requests) > MAX_REQUESTS:
        raise bad_request("requests", f"at most {MAX_REQUESTS} requests a batch, got "
                                      f"{len(requests)}")
    items, seen = [], set()
    for n, request in enumerate(requests):
        at = f"requests.{n}"
        if not isinstance(request, dict):
            raise bad_request(at, f"must be an object, not {_kind(request)}")
        custom_id, params = request.get("custom_id"), request.get("params")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise bad_request(f"{at}.custom_id", "must be 1-64 letters, digits, '_' or '-', "
                                                 f"got {shown(custom_id)}")
        if custom_id in seen:
            raise bad_request(f"{at}.custom_id", f"{shown(custom_id)} is used by an earlier "
                                                 "request; each must be unique in the batch")
        if not isinstance(params, dict):
            raise bad_request(f"{at}.params", f"must be an object, not {_kind(params)}")
        seen.add(custom_id)
        items.append(BatchItem(custom_id, params))
    return items
