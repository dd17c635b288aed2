"""What `top` shows, as plain data computed from /v1/state snapshots: request rows and their
sort and filter, tenant rows, and the history behind the rates and sparklines. No widgets here."""

from __future__ import annotations

import dataclasses
import zlib
from collections import deque
from dataclasses import dataclass, field

from tokstream.state_snapshot import RequestRow, StateSnapshot
from tokstream.top.source import Frame

COLUMNS = ["id", "tenant", "state", "prompt_tokens", "output_tokens", "blocks", "ttft_ms",
           "itl_ms", "tokens_per_s", "age_s"]
"""Request columns, in table order; `s` cycles the sort through them."""

PALETTE = ["#e06c75", "#98c379", "#e5c07b", "#61afef", "#c678dd", "#56b6c2", "#d19a66",
           "#be5046", "#7ec699", "#f0a6ca", "#a9b1ff", "#ffd866"]
"""Request colours: a request's KV blocks and its id in the table share one."""

HISTORY_S = 60.0


def owner_colour(request_id: str) -> str:
    """Stable across polls and runs, so a request keeps its colour while it lives."""
    return PALETTE[zlib.crc32(request_id.encode()) % len(PALETTE)]


BACKGROUND_STATE = {"preempted": "preempt", "recovering": "recover", "finishing": "finish",
                    "submitted": "submit"}
"""A batch request's state, cut so that " bg" after it fits the STATE column (10)."""


def request_rows(state: StateSnapshot) -> list[RequestRow]:
    """The /v1/state request rows with `state` as top shows it: waiting, prefill, decode,
    preempted, recovering (paused by a replica restart, or re-prefilling what it had after
    one), finishing (delivered, closing) or submitted (not yet in the engine), with " bg"
    after it for a Message Batch's request."""
    rows = []
    for row in state.requests:
        phase = row.phase or row.state
        resumed_refill = row.resumes > 0 and phase in ("waiting", "prefill")
        if phase != "finishing" and (state.recovering or resumed_refill):
            phase = "recovering"
        if row.background:  # a Message Batch's: it yields every step chat needs
            phase = BACKGROUND_STATE.get(phase, phase) + " bg"
        rows.append(dataclasses.replace(row, state=phase, tenant=row.tenant or "-"))
    return rows


def sort_rows(rows: list[RequestRow], column: str, reverse: bool) -> list[RequestRow]:
    """Sorted by column; rows without a value (None) always go last; ties by id."""
    present = sorted((r for r in rows if getattr(r, column) is not None),
                     key=lambda r: (getattr(r, column), r.id), reverse=reverse)
    return present + sorted((r for r in rows if getattr(r, column) is None), key=lambda r: r.id)


def filter_rows(rows: list[RequestRow], text: str) -> list[RequestRow]:
    """Rows whose id, tenant or state contains every word of text (case-insensitive)."""
    words = text.lower().split()
    return [r for r in rows if all(
        any(w in str(getattr(r, k) or "").lower() for k in ("id", "tenant", "state"))
        for w in words)]


def tenant_rows(state: StateSnapshot) -> list[dict]:
    """Per tenant: share of the tokens served, running and waiting requests, the fairness
    counter, and its configured limits when the server has a tenants file."""
    fairness = {row.tenant: row for row in state.fairness or []}
    configured = {row.name: row for row in state.tenants}
    counts: dict[str, dict[str, int]] = {}
    for row in request_rows(state):
        running = row.state in ("prefill", "decode", "finishing")
        tally = counts.setdefault(row.tenant, {"running": 0, "waiting": 0})
        tally["running" if running else "waiting"] += 1
    names = sorted(set(fairness) | set(configured) | set(counts))
    total = sum(row.served_tokens for row in fairness.values())
    rows = []
    for name in names:
        ledger, config = fairness.get(name), configured.get(name)
        served = ledger.served_tokens if ledger else 0
        rows.append({"tenant": name, "share": served / total if total else None,
                     "served_tokens": served, **counts.get(name, {"running": 0, "waiting": 0}),
                     "counter": ledger.counter if ledger else None,
                     "weight": config.weight if config else None,
                     "priority": config.priority if config else None,
                     "refusals": config.refusals if config else None})
    return rows


@dataclass
class Sample:
    uptime_s: float
    prompt_tokens: float
    output_tokens: float
    running: int
    step_tokens: int
    waiting: int
    draft_tokens: int = 0
    """Speculative decoding's counters since the core started (0 with it off)."""
    accepted_tokens: int = 0


@dataclass
class History:
    """The last minute of polls, on the server's clock (its uptime), so rates come out the
    same whether top polls every 0.2 s or replays a recording."""

    samples: deque = field(default_factory=deque)

    def add(self, frame: Frame) -> None:
        batch = frame.state.batch
        uptime = frame.state.replica.uptime_s
        if self.samples and uptime <= self.samples[-1].uptime_s:
            self.samples.clear()  # a new server (or the same snapshot twice): start over
        # Prompt tokens: prefilled by the engine (its own counter); output tokens: delivered
        # to callers (/metrics).
        spec = frame.state.speculation
        self.samples.append(Sample(uptime, batch.prefill_tokens_total or 0,
                                   frame.counters.get("output_tokens", 0.0),
                                   batch.running, batch.last_step_tokens, batch.waiting,
                                   spec.num_draft_tokens or 0, spec.num_accepted_tokens or 0))
        while uptime - self.samples[0].uptime_s > HISTORY_S:
            self.samples.popleft()

    def rate(self, name: str) -> float | None:
        """Tokens/s of a counter between the last two polls."""
        if len(self.samples) < 2:
            return None
        before, now = self.samples[-2], self.samples[-1]
        return max(0.0, getattr(now, name) - getattr(before, name)) / (now.uptime_s
                                                                       - before.uptime_s)

    def recent_acceptance(self) -> float | None:
        """Accepted over drafted tokens between the last two polls (None: no drafts then, or
        a single poll so far)."""
        if len(self.samples) < 2:
            return None
        before, now = self.samples[-2], self.samples[-1]
        drafted = now.draft_tokens - before.draft_tokens
        if drafted <= 0:  # nothing drafted, or the core restarted and its counters with it
            return None
        return max(0, now.accepted_tokens - before.accepted_tokens) / drafted

    def series(self, name: str) -> list[float]:
        return [float(getattr(s, name)) for s in self.samples]
