"""What a fault did to each stream, read from the recorded history: was it in flight, what did
it have before, how long did its caller wait, did it come back."""

from __future__ import annotations

from tokstream.chaos.history import Violations
from tokstream.chaos.workload import StreamHistory
from tokstream.state_snapshot import RequestRow


def around_fault(histories: list[StreamHistory], fault_s: float,
                 state_rows: dict[str, RequestRow],
                 violations: Violations) -> tuple[list[dict], float | None]:
    """Per stream live at the fault: its state then, tokens before and after, the pause its
    caller saw; and the recovery time (fault -> every one of them has its next token)."""
    rows, recovery = [], None
    for history in histories:
        ended = history.ended_at
        if history.started > fault_s or (ended is not None and ended <= fault_s) \
                or history.status_code not in (None, 200):
            continue
        times = history.times()
        before = [t for t in times if t <= fault_s]
        after = [t for t in times if t > fault_s]
        engine = state_rows.get(history.request_id or "")
        row = {"stream": history.spec.name, "role": history.spec.role,
               "sampling": history.spec.sampling, "request_id": history.request_id,
               "state_at_fault": _state(engine), "tokens_before": len(before),
               "tokens_after": len(after), "pause_s": None, "resumed_after_s": None,
               "sent_before_fault_s": fault_s - history.started}
        if after:
            row["resumed_after_s"] = after[0] - fault_s
            row["pause_s"] = after[0] - (before[-1] if before else fault_s)
            recovery = max(recovery or 0.0, row["resumed_after_s"])
        elif not history.hung_up and len(before) < (history.spec.max_tokens or 0):
            violations.add("not_recovered", f"{history.spec.name}: live at the fault, no token "
                                            "after it")
        rows.append(row)
    return rows, recovery


def _state(row: RequestRow | None) -> str:
    if row is None:
        return "not yet in the engine"
    computed, prompt = row.computed_tokens or 0, row.prompt_tokens
    if row.state == "running" and computed < prompt:
        return f"prefilling {computed}/{prompt}"
    if row.state == "running":
        return f"decoding (token {row.output_tokens})"
    return row.state or "?"
