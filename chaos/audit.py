"""The content audit of greedy streams a fault interrupted (resumed after a restart, or
preempted and recomputed): re-score each whole output in one teacher-forced pass through the
server's /v1/score and require every token to be the argmax within a logit tolerance (exact
equality can break on near-ties when batch shapes change); count how many are also identical
to the fault-free run."""

from __future__ import annotations

from tokstream.chaos.api import ServerAPI
from tokstream.chaos.history import Violations

LOGIT_TOLERANCE = 0.01


async def audit(api: ServerAPI, rows: list[dict], messages: dict[str, list[dict]],
                reference: dict[str, list[int]], names: set[str],
                violations: Violations) -> list[dict]:
    """rows: the round's stream rows; names: the streams the fault interrupted. Returns one
    result per audited (greedy, interrupted, with output) stream."""
    results = []
    for row in rows:
        if row["name"] not in names or row["sampling"] != "greedy" or not row["token_ids"]:
            continue
        positions = await api.score(messages[row["name"]], row["token_ids"])
        gaps = [p["top_logit"] - p["logit"] for p in positions]
        off = [i for i, gap in enumerate(gaps) if gap > LOGIT_TOLERANCE]
        if off:
            violations.add("off_argmax", f"{row['name']} ({row['request_id']}): tokens at "
                                         f"{off[:5]} are more than {LOGIT_TOLERANCE} below the "
                                         f"top logit (largest gap {max(gaps):.4f})", len(off))
        expected = reference.get(row["name"])
        results.append({
            "stream": row["name"], "request_id": row["request_id"], "tokens": len(gaps),
            "max_gap": max(gaps, default=0.0), "off_argmax": len(off),
            "identical_to_fault_free": (None if expected is None
                                        else expected == row["token_ids"])})
    return results
