"""Reading a `tokstream chaos` JSON report in tests."""

from __future__ import annotations


def resumed_after_fault(report: dict, fault: dict) -> bool:
    """Every stream live at the fault that still had tokens to come got some after it. A
    stream whose last token arrived just before the fault and whose end (the finish event,
    [DONE]) just after counts as live at the fault with nothing left to resume: with drafts
    accepted, a 16-token greedy stream is done in ~60 ms."""
    received = {stream["name"]: stream["tokens"] for stream in report["streams"]}
    return all(row["tokens_after"] > 0 for row in fault["in_flight"]
               if row["tokens_before"] < received[row["stream"]])
