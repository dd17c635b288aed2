"""The terminal view of a report: rich tables per class and per tenant, then the verdict."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(title: str, blocks: dict[str, dict], key_title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (key_title, "sent", "ok", "failed", "TTFT p50/p90/p99 ms",
                   "ITL p50/p90/p99 ms", "TPOT p50 ms", "e2e p50/p99 s", "out tok/s",
                   "goodput req/s"):
        table.add_column(column, justify="left" if column == key_title else "right")
    for name, b in blocks.items():
        table.add_row(
            name, str(b["requests"]), str(b["completed"]), str(b["failed"]),
            "/".join(_ms(b["ttft_s"][p]) for p in ("p50", "p90", "p99")),
            "/".join(_ms(b["itl_s"][p]) for p in ("p50", "p90", "p99")),
            _ms(b["tpot_s"]["p50"]),
            f"{_num(b['e2e_s']['p50'], 2)}/{_num(b['e2e_s']['p99'], 2)}",
            _num(b["output_tokens_per_s"]), _num(b["goodput"]["requests_per_s"], 2))
    return table


def _fair_share_table(shares: dict[str, dict]) -> Table:
    table = Table(title="Fairness against demand (input + output tokens/s)",
                  title_justify="left")
    for column in ("tenant", "weight", "demand", "fair share", "achieved",
                   "achieved / fair share"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for name, share in shares.items():
        table.add_row(name, _num(share["weight"], 2), _num(share["demand_tokens_per_s"]),
                      _num(share["fair_share_tokens_per_s"]),
                      _num(share["achieved_tokens_per_s"]), _num(share["ratio"], 3))
    return table


def _share(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def speculation_line(spec: dict) -> str:
    """The server's speculative decoding over the run, in one line."""
    line = (f"speculation: {spec['accepted_tokens']:,} of {spec['draft_tokens']:,} drafted "
            f"tokens accepted ({_share(spec['acceptance_rate'])}) in {spec['drafts']:,} "
            f"drafts, mean acceptance length {_num(spec['mean_acceptance_length'], 2)}")
    if spec["acceptance_per_position"]:
        line += "; by position " + " ".join(map(_share, spec["acceptance_per_position"]))
    if spec["counters_reset"]:
        line += " (the engine restarted during the run: counted since then)"
    return line


def print_sweep(report: dict, console: Console | None = None) -> None:
    """The sweep's table: one row a stage, then its capacity and verdict."""
    import sys

    console = console or Console(width=None if sys.stdout.isatty() else 150)
    sweep = report["sweep"]
    table = Table(title=f"Sweep of mix {report['config']['mix_name']}", title_justify="left")
    for column in ("stage", "offered req/s", "achieved req/s", "out tok/s",
                   "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "sent", "ok", "failed",
                   "cancelled"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for row in sweep["stages"]:
        offered = (_num(row["offered_requests_per_s"], 3) if row["offered_requests_per_s"]
                   is not None else f"closed, {row['users']} user"
                   + ("s" if row["users"] > 1 else ""))
        table.add_row(row["name"], offered, _num(row["achieved_requests_per_s"], 3),
                      _num(row["output_tokens_per_s"]),
                      "/".join(_ms(row["ttft_s"][p]) for p in ("p50", "p90", "p99")),
                      "/".join(_ms(row["itl_s"][p]) for p in ("p50", "p90", "p99")),
                      str(row["sent"]), str(row["completed"]), str(row["failed"]),
                      str(row["cancelled"]))
    console.print(table)
    capacity = sweep["capacity"]
    console.print(f"synchronous rate {_num(sweep['synchronous_requests_per_s'], 3)} req/s; "
                  f"capacity {_num(capacity and capacity['requests_per_s'], 3)} req/s"
                  + (f" ({capacity['users']} users)" if capacity else "")
                  + ("; the mix's bursts were left out" if sweep["bursts_left_out"] else ""),
                  highlight=False)
    for reason in report["verdict"]["reasons"]:
        console.print(f"[bold red]FAIL[/]: {reason}", highlight=False)


def print_report(report: dict, reasons: list[str], console: Console | None = None) -> None:
    import sys

    # Pipes and CI logs get the full table rather than an 80-column squeeze.
    console = console or Console(width=None if sys.stdout.isatty() else 150)
    summary = report["summary"]
    console.print(_table("By workload class", {**report["class"], "all": summary}, "class"))
    console.print(_table("By tenant", report["tenant"], "tenant"))
    shares = summary["fairness"]["per_tenant"]
    if len(shares) > 1:
        console.print(_fair_share_table(shares))
    integrity = summary["integrity"]
    fairness = summary["fairness"]
    slo = summary["goodput"]["slo"]
    settings = report["config"].get("settings", {})
    lines = []
    if settings.get("capacity"):
        capacity = settings["capacity"]
        lines.append(f"rate {settings['rate']:.3g} req/s = {settings['capacity_fraction']:g} x "
                     f"capacity {capacity['requests_per_s']:.3g} req/s ({capacity['source']})")
    lines += [
        f"duration {summary['duration_s']:.1f} s; output {_num(summary['output_tokens_per_s'])} "
        f"tok/s, total {_num(summary['total_tokens_per_s'])} tok/s",
        f"goodput {_num(summary['goodput']['requests_per_s'], 2)} req/s "
        f"({summary['goodput']['requests']} of {summary['requests']} requests"
        + (f" within {', '.join(f'{k} {v:g}s' for k, v in slo.items())}" if slo
           else " completed; no --slo given") + ")",
        f"integrity: {integrity['streams_checked']} streams checked, "
        f"{integrity['streams_failed']} failed {integrity['problems'] or ''}".rstrip(),
        f"fairness: Jain's index {_num(fairness['jain_index_fair_share'], 3)} over achieved / "
        f"max-min fair share (worst tenant {_num(fairness['min_fair_share_ratio'], 2)} of its "
        f"share); raw {_num(fairness['jain_index_raw_tokens'], 3)} over tokens/s whatever "
        f"each asked, {_num(fairness['jain_index_ttft'], 3)} over 1/TTFT",
        f"requests clamped to the context: {summary['clamped']}; prompts raised to the "
        f"template's minimum: {summary['raised_to_minimum']}; prompts not the length planned: "
        f"{summary['prompt_tokens_mismatched']}; open-loop arrivals late: "
        f"{summary['late_arrivals']}",
    ]
    if "speculation" in summary:
        lines.append(speculation_line(summary["speculation"]))
    if summary["errors"]:
        lines.append(f"errors: {summary['errors']}")
    for line in lines:
        console.print(line, highlight=False)
    for reason in reasons:
        console.print(f"[bold red]FAIL[/]: {reason}", highlight=False)
