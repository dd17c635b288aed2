"""Tables: requests (sortable, filterable, Enter opens one), tenants, and the event log."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from tokstream.core_state import Event
from tokstream.state_snapshot import RequestRow
from tokstream.top import format as fmt
from tokstream.top.view import BACKGROUND_STATE, COLUMNS, owner_colour

HEADINGS = {"id": "ID", "tenant": "TENANT", "state": "STATE", "prompt_tokens": "PROMPT",
            "output_tokens": "OUTPUT", "blocks": "BLOCKS", "ttft_ms": "TTFT", "itl_ms": "ITL",
            "tokens_per_s": "TOK/S", "age_s": "AGE"}
WIDTHS = {"id": 28, "tenant": 10, "state": 10, "prompt_tokens": 8, "output_tokens": 8,
          "blocks": 8, "ttft_ms": 8, "itl_ms": 8, "tokens_per_s": 7, "age_s": 8}
"""Fixed, so columns stay put from one refresh to the next (longer values are cut)."""
ACCEPTED_WIDTH = 11
"""The ACCEPTED column (speculation on only, after the others; not in the sort cycle)."""
STATE_COLOUR = {"waiting": "#abb2bf", "submitted": "#abb2bf", "prefill": "#61afef",
                "decode": "#98c379", "preempted": "#e5c07b", "recovering": "#e06c75",
                "finishing": "#5c6370"}
FULL_STATE = {short: name for name, short in BACKGROUND_STATE.items()}
EVENT_COLOUR = {"preempted": "#e5c07b", "rank_failure": "bold #e06c75",
                "engine_dead": "bold #e06c75", "restart_failed": "#e06c75",
                "engine_restart_failed": "#e06c75", "restarted": "#98c379",
                "engine_restarted": "#98c379", "refused": "#c678dd",
                "request_failed": "#e06c75", "cancelled": "#d19a66"}


def _cell(row: RequestRow, column: str) -> Text | str:
    value = getattr(row, column)
    if column == "id":
        return Text(value, style=owner_colour(value))
    if column == "state":  # "decode bg", "preempt bg" (a batch's) in decode's, preempted's colour
        word = value.split(" ")[0]
        return Text(value, style=STATE_COLOUR.get(FULL_STATE.get(word, word), ""))
    if column in ("ttft_ms", "itl_ms"):
        return fmt.ms(value)
    if column == "tokens_per_s":
        return fmt.number(value, 1)
    if column == "age_s":
        return fmt.seconds(value)
    if column == "tenant":
        return value
    return fmt.number(value)


def _accepted(row: RequestRow) -> str:
    """Accepted/drafted tokens, '-' for a request the core has not drafted for (not in the
    core yet, or a core that does not count them)."""
    drafted, accepted = row.draft_tokens, row.accepted_tokens
    if not isinstance(drafted, int) or not isinstance(accepted, int):  # None or ABSENT
        return "-"
    return f"{fmt.number(accepted)}/{fmt.number(drafted)}"


class RequestsTable(DataTable):
    """Rows keyed by request id; the cursor stays on its request across refreshes."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True

    def show(self, rows: list[RequestRow], sort_column: str, reverse: bool,
             speculating: bool = False) -> None:
        """speculating: add the ACCEPTED column (accepted/drafted tokens of each request)."""
        selected = self.selected_id
        self.clear(columns=True)
        for column in COLUMNS:
            arrow = (" ▼" if reverse else " ▲") if column == sort_column else ""
            self.add_column(HEADINGS[column] + arrow, key=column, width=WIDTHS[column])
        if speculating:
            self.add_column("ACCEPTED", key="accepted", width=ACCEPTED_WIDTH)
        for row in rows:
            cells = [_cell(row, c) for c in COLUMNS]
            self.add_row(*cells, *([_accepted(row)] if speculating else []), key=row.id)
        if selected is not None and selected in self.rows:
            self.move_cursor(row=self.get_row_index(selected), animate=False)

    @property
    def selected_id(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value


class TenantsTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        for label in ("TENANT", "SHARE", "TOKENS", "RUNNING", "WAITING", "COUNTER", "WEIGHT",
                      "PRIORITY", "REFUSALS"):
            self.add_column(label)

    def show(self, rows: list[dict]) -> None:
        self.clear()
        for row in rows:
            share = row["share"]
            self.add_row(row["tenant"], "-" if share is None else f"{share:.1%}",
                         fmt.number(row["served_tokens"]), str(row["running"]),
                         str(row["waiting"]), fmt.number(row["counter"], 1),
                         fmt.number(row["weight"], 1), fmt.number(row["priority"]),
                         fmt.number(row["refusals"]))


class EventsTable(DataTable):
    """Newest last; the log keeps every event top has seen (bounded), not just the server's
    current window."""

    def on_mount(self) -> None:
        self.cursor_type = "none"
        for label in ("TIME (UTC)", "EVENT", "REQUEST", "DETAIL"):
            self.add_column(label)

    def show(self, events: list[Event]) -> None:
        self.clear()
        for event in events:
            detail = "  ".join(f"{k}={v}" for k, v in event.extra.items()
                               if k != "source" and v not in (None, ""))
            kind = event.kind or "?"
            self.add_row(fmt.clock(event.time), Text(kind, style=EVENT_COLOUR.get(kind, "")),
                         event.request_id or "", detail)
        self.scroll_end(animate=False)
