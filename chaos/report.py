"""The terminal report: what was in flight at each fault, what happened to every stream, how
long callers waited, and the verdict; and the JSON file."""

from __future__ import annotations

import json

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

CONTRAST = ("For contrast, vLLM, SGLang, TensorRT-LLM and TGI stop or wedge when a rank or "
            "their engine core dies mid-batch: each of these streams would have ended in an "
            "error (or hung), and the server would need restarting from outside.")


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")


def render(report: dict, console: Console) -> None:
    server = report.get("server", {})
    console.print(Panel.fit(
        f"[b]tokstream chaos {report['experiment']}[/b]: {report['summary']}\n"
        f"server {report['target']['url']} ({'started by chaos' if report['target']['own_server'] else 'given'}): "
        f"{server.get('model')} tp={server.get('tp')} {server.get('device')} "
        f"{server.get('dtype')}, KV {server.get('num_blocks')} blocks x "
        f"{server.get('block_size')}, token budget {server.get('token_budget')}"))
    steady = report.get("steady_state")
    if steady:
        console.print(f"steady state: /health {steady['health']}, replica {steady['status']}, "
                      f"probe stream {steady['probe']}, {steady['baseline_used_blocks']} KV "
                      "blocks used at rest")
    streams = report.get("streams", [])
    for fault in report.get("faults", []):
        _fault(console, fault, [s for s in streams if s["round"] == fault["round"]])
    _verdict(console, report)


def _fault(console: Console, fault: dict, streams: list[dict]) -> None:
    title = f"round {fault['round']}: {fault['kind']}"
    if "signal" in fault:
        title += f" - {fault['signal']} {fault['target']} (pid {fault['pid']}) at " \
                 f"{fault['at_s']:.2f} s"
    console.rule(title)
    if fault.get("trigger"):
        console.print(f"when: {fault['trigger']}")
    if fault.get("engine_events"):
        console.print("server: " + "; ".join(
            f"{e['kind']}" + (f" ({e['reason']})" if e.get("reason") else "")
            for e in fault["engine_events"]))
    if fault.get("stopped_process_after_round"):
        console.print(f"stopped process after the round: {fault['stopped_process_after_round']}")
    if "in_flight" in fault:
        table = Table("stream", "sampling", "at the fault", "tokens before", "pause (s)",
                      "tokens after", "ended", title="in flight at the fault")
        classes = {s["name"]: s for s in streams}
        for row in fault["in_flight"]:
            stream = classes.get(row["stream"], {})
            table.add_row(row["stream"], row["sampling"], row["state_at_fault"],
                          str(row["tokens_before"]), _seconds(row["pause_s"]),
                          str(row["tokens_after"]), _ended(stream))
        console.print(table)
        recovered = fault.get("recovery_s")
        console.print(f"every stream in flight had its next token {_seconds(recovered)} s "
                      f"after the fault; the server measured "
                      f"{_recoveries(fault.get('server_recovery_s'))}")
    else:
        table = Table("stream", "sampling", "client", "tokens", "preempted", "ended")
        for s in streams:
            table.add_row(s["name"], s["sampling"], s["client"], f"{s['tokens']}/{s['max_tokens']}",
                          str(s.get("preemptions", 0)), _ended(s))
        console.print(table)
        for key in ("preemptions", "num_blocks", "demand_tokens"):
            if key in fault:
                console.print(f"{key.replace('_', ' ')}: {fault[key]}")


def _verdict(console: Console, report: dict) -> None:
    content = report.get("content", {})
    if content.get("audited"):
        console.print(f"content: {content['within_tolerance']}/{content['audited']} interrupted "
                      f"greedy streams re-scored within 0.01 of the top logit at every token; "
                      f"{content['identical_to_fault_free']}/{content['compared']} identical to "
                      "the fault-free run")
    console.print("streams: " + ", ".join(f"{n} {c}" for c, n in
                                          sorted(report.get("classes", {}).items())))
    bad = {k: n for k, n in report["violations"].items() if n}
    if report["ok"]:
        console.print(f"[green b]PASS[/green b]: every invariant held "
                      f"(no token lost, duplicated, reordered or foreign; every stream ended "
                      f"once; KV blocks and requests back to baseline) in "
                      f"{report['duration_s']:.1f} s")
        in_flight = [row for f in report.get("faults", []) for row in f.get("in_flight", [])]
        if in_flight:
            back = sum(row["tokens_after"] > 0 for row in in_flight)
            longest = max((row["pause_s"] or 0.0) for row in in_flight)
            console.print(f"{len(in_flight)} streams were in flight at "
                          f"{len(report['faults'])} fault(s): {back} came back and carried on "
                          f"(longest pause {longest:.2f} s), none saw an error. {CONTRAST}")
    else:
        console.print(f"[red b]FAIL[/red b]: {bad}")
        for line in report["violation_details"][:20]:
            console.print(f"  {line}", markup=False)


def _ended(stream: dict) -> str:
    if not stream:
        return "?"
    if stream["class"] == "complete":
        return f"complete ({stream['finish_reason']})"
    if stream["class"] == "failed":
        return f"error: {(stream.get('error') or {}).get('type')}"
    return stream["class"] + (" (client hung up)" if stream["client"] == "hung up" else "")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _recoveries(by_kind: dict | None) -> str:
    if not by_kind:
        return "nothing"
    return ", ".join(f"{kind} {', '.join(f'{v:.2f} s' for v in values)}"
                     for kind, values in by_kind.items())
