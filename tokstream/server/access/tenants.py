"""Tenants and API keys, from a TOML file (`--tenants FILE`).

    admin_key_sha256 = "9f86d0…"          # sha256 hex of the admin key (admin routes)
    metrics_key_sha256 = "60303a…"        # optional: a key that may only read /metrics

    [[tenant]]
    name = "alice"
    key_sha256 = "2c26b4…"                # sha256 hex of alice's API key; never the key itself
    weight = 2.0                          # share of service when backlogged (fairness)
    priority = 0                          # tier: lower is admitted first, preempted last
    tokens_per_minute = 200000            # prompt + max_tokens reserved at admission, the
                                          # unused part refunded at the end; 0 = no limit
    max_concurrent = 32                   # live requests; 0 = no limit

Keys arrive as `x-api-key` or `Authorization: Bearer`; the presented key is hashed and compared
against every stored hash with hmac.compare_digest, without stopping at a match, so timing
says nothing about which key or how much of it matched. `tokstream hash-key KEY` prints a hash.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokstream.errors import UserInputError
from tokstream.toml_file import read_toml
from tokstream.server.api_errors import ApiError

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass
class Tenant:
    """One [[tenant]] of the tenants file: its limits as the file gives them (the fields up to
    max_concurrent), then what it is using now."""

    name: str
    """Unique in the file; names the tenant in /v1/state, /metrics, events and errors."""
    key_sha256: str
    """sha256 hex (lower case) of the tenant's API key; the key itself is never stored."""
    weight: float = 1.0
    """Share of service when backlogged, against the other tenants': the engine's fair queue
    serves by it, and it is the tenant's share of the admission queue's bounds."""
    priority: int = 0
    """Tier: lower is admitted first, preempted last."""
    tokens_per_minute: int = 0
    """Token budget refilled continuously; 0 means unlimited.

    A request reserves its prompt and max_tokens at admission; settle() refunds what it did
    not generate."""
    max_concurrent: int = 0
    """Live requests at once; 0 means unlimited."""
    live: int = 0
    """Requests admitted and not yet settled."""
    tokens: float = field(default=0.0)
    """Current bucket balance (starts full)."""
    refilled_at: float = field(default_factory=time.monotonic)
    """When the bucket was last topped up (time.monotonic())."""
    prompt_tokens_total: int = 0
    """Prompt tokens admitted since the server started."""
    output_tokens_total: int = 0
    """Output tokens of the requests settled since the server started."""
    refusals: int = 0
    """429s for either limit since the server started."""

    def __post_init__(self):
        self.tokens = float(self.tokens_per_minute)

    def _refill(self, now: float) -> None:
        if self.tokens_per_minute:
            rate = self.tokens_per_minute / 60.0
            self.tokens = min(float(self.tokens_per_minute),
                              self.tokens + (now - self.refilled_at) * rate)
        self.refilled_at = now

    def admit(self, num_prompt_tokens: int, max_tokens: int = 0,
              background: bool = False) -> None:
        """Raise 429 past a limit; otherwise count the request in and reserve its prompt and
        all the output it may produce (max_tokens), so concurrent requests cannot overrun
        the budget between admission and their end. background (a Message Batch's request):
        counted in the totals only. Its limits are --batch-concurrency's, server-wide, as
        the API keeps batches' limits apart from its interactive ones: a tenant's batch never
        takes the slots or the tokens its interactive requests need."""
        if background:
            self.prompt_tokens_total += num_prompt_tokens
            return
        if self.max_concurrent and self.live >= self.max_concurrent:
            self.refusals += 1
            raise ApiError("rate_limit_error",
                           f"tenant {self.name!r} has {self.live} requests in flight (limit "
                           f"{self.max_concurrent})", retry_after=1)
        self._take(num_prompt_tokens + max_tokens)
        self.live += 1
        self.prompt_tokens_total += num_prompt_tokens

    def charge(self, num_tokens: int) -> None:
        """Charge work that is not a generation (count_tokens); 429 when over the budget."""
        self._take(num_tokens)

    def _take(self, num_tokens: int) -> None:
        now = time.monotonic()
        self._refill(now)
        if not self.tokens_per_minute:
            return
        # A request bigger than the whole budget is let in when the bucket is full.
        needed = min(num_tokens, self.tokens_per_minute)
        if self.tokens < needed:
            self.refusals += 1
            wait = (needed - self.tokens) / (self.tokens_per_minute / 60.0)
            raise ApiError("rate_limit_error",
                           f"tenant {self.name!r} is over its limit of "
                           f"{self.tokens_per_minute} tokens per minute",
                           retry_after=math.ceil(wait))
        self.tokens -= num_tokens

    def settle(self, max_tokens: int, num_output_tokens: int, background: bool = False) -> None:
        """The request ended after num_output_tokens: refund the unused reservation."""
        self.output_tokens_total += num_output_tokens
        if background:
            return
        self.live -= 1
        if self.tokens_per_minute:
            self._refill(time.monotonic())
            self.tokens = min(float(self.tokens_per_minute),
                              self.tokens + max(0, max_tokens - num_output_tokens))

    def row(self) -> dict:
        self._refill(time.monotonic())
        return {"name": self.name, "weight": self.weight, "priority": self.priority,
                "tokens_per_minute": self.tokens_per_minute,
                "max_concurrent": self.max_concurrent, "live": self.live,
                "tokens_available": (round(self.tokens) if self.tokens_per_minute else None),
                "prompt_tokens": self.prompt_tokens_total,
                "output_tokens": self.output_tokens_total, "refusals": self.refusals}


@dataclass
class Tenants:
    tenants: list[Tenant]
    admin_key_sha256: str | None = None
    metrics_key_sha256: str | None = None
    """A key that may read /metrics and nothing else (what Prometheus is given)."""

    def authenticate(self, key: str | None) -> Tenant:
        """The tenant whose key this is; 401 if none."""
        if not key:
            raise ApiError("authentication_error",
                           "missing API key: send x-api-key or Authorization: Bearer")
        digest = hash_key(key)
        found = None
        for tenant in self.tenants:  # no early exit: every comparison runs
            if hmac.compare_digest(digest, tenant.key_sha256):
                found = tenant
        if found is None:
            raise ApiError("authentication_error", "invalid API key")
        return found

    def authenticate_admin(self, key: str | None) -> None:
        if not key:
            raise ApiError("authentication_error",
                           "missing admin key: send x-api-key or Authorization: Bearer")
        if self.admin_key_sha256 is None:
            raise ApiError("permission_error", "no admin key is configured in the tenants file")
        if not hmac.compare_digest(hash_key(key), self.admin_key_sha256):
            raise ApiError("permission_error", "admin routes need the admin key")

    def authenticate_metrics(self, key: str | None) -> None:
        """/metrics names tenants and their volumes: the admin key or the metrics key."""
        if not key:
            raise ApiError("authentication_error", "missing key: /metrics needs the admin or "
                                                   "the metrics key (Authorization: Bearer)")
        digest = hash_key(key)
        allowed = [h for h in (self.admin_key_sha256, self.metrics_key_sha256) if h]
        if not any([hmac.compare_digest(digest, h) for h in allowed]):
            raise ApiError("permission_error", "/metrics needs the admin or the metrics key")


TENANT_FIELDS = {"name", "key_sha256", "weight", "priority", "tokens_per_minute",
                 "max_concurrent"}


def load_tenants(path: str | Path) -> Tenants:
    path = Path(path)
    data = read_toml(path, "tenants file")
    where = f"tenants file {path}"
    admin = data.get("admin_key_sha256")
    if admin is not None and not (isinstance(admin, str) and HEX64.match(admin.lower())):
        raise UserInputError(f"{where}: admin_key_sha256 must be 64 hex digits (sha256)")
    metrics_key = data.get("metrics_key_sha256")
    if metrics_key is not None and not (isinstance(metrics_key, str)
                                        and HEX64.match(metrics_key.lower())):
        raise UserInputError(f"{where}: metrics_key_sha256 must be 64 hex digits (sha256)")
    entries = data.get("tenant", [])
    if not isinstance(entries, list) or not entries:
        raise UserInputError(f"{where}: needs at least one [[tenant]] table")
    tenants, names, hashes = [], set(), set()
    for n, entry in enumerate(entries):
        at = f"{where}: tenant[{n}]"
        unknown = set(entry) - TENANT_FIELDS
        if unknown:
            raise UserInputError(f"{at}: unknown field(s) {', '.join(sorted(unknown))}")
        name, key = entry.get("name"), entry.get("key_sha256")
        if not isinstance(name, str) or not name:
            raise UserInputError(f"{at}: name must be a non-empty string")
        if not isinstance(key, str) or not HEX64.match(key.lower()):
            raise UserInputError(f"{at}: key_sha256 must be 64 hex digits "
                                 "(tokstream hash-key KEY prints it)")
        if name in names or key.lower() in hashes:
            raise UserInputError(f"{at}: duplicate tenant name or key")
        names.add(name)
        hashes.add(key.lower())
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise UserInputError(f"{at}: weight must be a number > 0")
        fields = {}
        for int_field in ("priority", "tokens_per_minute", "max_concurrent"):
            value = entry.get(int_field, 0)
            if not isinstance(value, int) or isinstance(value, bool) or \
                    (int_field != "priority" and value < 0):
                raise UserInputError(f"{at}: {int_field} must be an integer"
                                     + ("" if int_field == "priority" else " >= 0"))
            fields[int_field] = value
        tenants.append(Tenant(name, key.lower(), float(weight), **fields))
    return Tenants(tenants, admin.lower() if admin else None,
                   metrics_key.lower() if metrics_key else None)
