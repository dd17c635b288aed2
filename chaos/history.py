"""The Jepsen-style history checker: every recorded stream of a run, judged against the
guarantees (each token delivered exactly once, in order, to its own caller only; each stream
ends exactly once, with a final event or an explicit error), and the server's state after the
run drained (KV blocks back to baseline, no request left behind).

Built on tokstream.checker, which checks one stream's events against the engine's own record
(indices, count, digest). This adds what only the whole history shows: which streams a client
cut on purpose (those may end early, but what they got must still be clean), refused
requests, and the leaks.
"""

from __future__ import annotations

from tokstream.checker import check_streams

from tokstream.chaos.workload import StreamHistory

VIOLATION_KINDS = ("lost", "duplicated", "reordered", "foreign", "unended", "ended_twice",
                   "after_end", "digest_mismatch", "count_mismatch", "malformed", "refused",
                   "leaked_blocks", "leaked_requests", "leaked_processes", "off_argmax",
                   "stalled", "not_recovered", "fault_not_injected", "block_bookkeeping",
                   "wrongly_failed", "drain_broken")
"""What an experiment counts; it exits 0 only when every count is 0."""

CHECKER_KINDS = {"lost": "lost", "duplicated": "duplicated", "reordered": "reordered",
                 "foreign": "foreign", "never_ended": "unended", "ended_twice": "ended_twice",
                 "after_end": "after_end", "count_mismatch": "count_mismatch",
                 "digest_mismatch": "digest_mismatch", "malformed": "malformed"}
"""tokstream.checker's problem kinds -> the report's violation kinds."""


class Violations:
    """Counts per kind, and a line for each."""

    def __init__(self):
        self.counts = {kind: 0 for kind in VIOLATION_KINDS}
        self.details: list[str] = []

    def add(self, kind: str, detail: str, count: int = 1) -> None:
        self.counts[kind] += count
        self.details.append(f"{kind}: {detail}")

    def merge(self, other: "Violations") -> None:
        for kind, n in other.counts.items():
            self.counts[kind] += n
        self.details += other.details

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())


def check_history(histories: list[StreamHistory], violations: Violations) -> list[dict]:
    """One row per stream (its class and what it got); every problem goes to violations.
    Classes: complete, failed (an explicit error event), cut (no end: a violation unless the
    client hung up itself), refused (a non-200 answer)."""
    report = check_streams([h.recorded() for h in histories])
    rows = []
    for history, checked in zip(histories, report.streams):
        spec = history.spec
        name = spec.name
        if history.status_code is not None and history.status_code != 200:
            violations.add("refused", f"{name}: HTTP {history.status_code} {history.body}")
            rows.append(_row(history, "refused", checked))
            continue
        for kind, detail in checked.problems:
            if kind == "never_ended" and history.hung_up:
                continue  # the client hung up: cut on purpose (a gap in what it got is
                # still lost: the checker counts indices missing below the last one received)
            violations.add(CHECKER_KINDS[kind], f"{name} ({history.request_id}): {detail}")
        if history.transport_error and not history.hung_up:
            violations.add("unended", f"{name}: the connection failed: "
                                      f"{history.transport_error}")
        rows.append(_row(history, checked.status, checked))
    return rows


def _row(history: StreamHistory, status: str, checked) -> dict:
    spec = history.spec
    times = history.times()
    return {
        "name": spec.name, "role": spec.role, "route": spec.route,
        "sampling": spec.sampling, "request_id": history.request_id,
        "class": status,
        "client": ("hung up" if history.hung_up else
                   "stopped reading" if history.stopped_reading else "read all"),
        "max_tokens": spec.max_tokens,
        "tokens": len(checked.token_ids),
        "token_ids": checked.token_ids,
        "finish_reason": checked.finish_reason,
        "error": checked.error,
        "problems": [f"{kind}: {detail}" for kind, detail in checked.problems],
        "started_s": history.started,
        "first_token_s": times[0] if times else None,
        "ended_s": history.ended_at,
        "stopped_reading_s": history.stopped_reading,
        "text": checked.text[-200:],
    }
