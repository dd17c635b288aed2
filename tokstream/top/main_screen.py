"""The main screen: the header over five views (overview, requests, KV cache, tenants,
events), and the keys that change what they show (sort, reverse, filter, views, back)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import ContentSwitcher, DataTable, Footer, Input

from tokstream.top.batch import BatchPanel
from tokstream.top.detail import DetailScreen
from tokstream.top.header import Header, speculating
from tokstream.top.kv_map import KvMap
from tokstream.top.tables import HEADINGS, EventsTable, RequestsTable, TenantsTable
from tokstream.top.view import COLUMNS, filter_rows, request_rows, sort_rows, tenant_rows

VIEWS = ["overview", "requests", "cache", "tenants", "events"]
TABLE_OF_VIEW = {"overview": "#requests-small", "requests": "#requests", "tenants": "#tenants",
                 "events": "#events"}


class MainScreen(Screen):
    DEFAULT_CSS = """
    MainScreen ContentSwitcher { height: 1fr; }
    MainScreen #overview-top { height: 12; }
    MainScreen RequestsTable { height: 1fr; }
    MainScreen #filter { dock: bottom; display: none; }
    MainScreen #filter.visible { display: block; }
    """
    BINDINGS = [
        Binding("s", "sort", "Sort"),
        Binding("r", "reverse", "Reverse"),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "back", "Back", show=False),
        *(Binding(str(n), f"view('{view}')", view.title(), show=False)
          for n, view in enumerate(VIEWS, 1)),
    ]

    def __init__(self):
        super().__init__()
        self.sort_column = "age_s"
        self.reverse = True
        self.filter_text = ""
        # Kept, not queried: a poll may land before they are mounted or after they are gone.
        self.header = Header(id="header")
        self.requests_tables = [RequestsTable(id="requests-small"), RequestsTable(id="requests")]
        self.kv_maps = [KvMap(id="kv-small"), KvMap(id="cache")]
        self.batch = BatchPanel()
        self.tenants = TenantsTable(id="tenants")
        self.events = EventsTable(id="events")
        self.switcher = ContentSwitcher(initial="overview")

    def compose(self) -> ComposeResult:
        yield self.header
        with self.switcher:
            with Vertical(id="overview"):
                with Horizontal(id="overview-top"):
                    yield self.kv_maps[0]
                    yield self.batch
                yield self.requests_tables[0]
            yield self.requests_tables[1]
            yield self.kv_maps[1]
            yield self.tenants
            yield self.events
        yield Input(placeholder="filter: id, tenant or state (Enter keeps it, Esc clears)",
                    id="filter", select_on_focus=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#requests-small").focus()
        self.redraw()

    @property
    def view(self) -> str:
        return self.switcher.current

    def notice(self) -> Text:
        app = self.app
        if app.failures:
            return Text(f"disconnected — retrying every {app.interval_s:g} s "
                        f"({app.failures} failed: {app.error})", style="bold #e06c75")
        if app.paused:
            return Text("PAUSED — p resumes", style="bold reverse #e5c07b")
        if app.frame is None:
            return Text("connecting …", style="dim")
        rows = request_rows(app.frame.state)
        shown = filter_rows(rows, self.filter_text)
        text = Text(f"{len(rows)} requests", style="bold")
        if self.filter_text:
            text.append(f" ({len(shown)} match filter '{self.filter_text}')")
        text.append(f"  sort {HEADINGS[self.sort_column]} {'▼' if self.reverse else '▲'}"
                    f"  view {self.view}   ? help", style="dim")
        return text

    def redraw(self) -> None:
        app = self.app
        state = app.frame.state if app.frame else None
        self.header.show(state, app.source.url, app.history.rate("prompt_tokens"),
                         app.history.rate("output_tokens"), self.notice(),
                         app.history.recent_acceptance())
        if app.frame is None:
            return
        # Only the view on screen: a hidden one is drawn when it is switched to.
        view = self.view
        if view in ("overview", "requests"):
            rows = sort_rows(filter_rows(request_rows(state), self.filter_text),
                             self.sort_column, self.reverse)
            self.requests_tables[view == "requests"].show(rows, self.sort_column, self.reverse,
                                                          speculating(state.speculation))
        if view in ("overview", "cache"):
            self.kv_maps[view == "cache"].show(state.kv)
        if view == "overview":
            self.batch.show(state, app.history)
        elif view == "tenants":
            self.tenants.show(tenant_rows(state))
        elif view == "events":
            self.events.show(app.event_log())

    # --- keys -------------------------------------------------------------------------------

    def action_sort(self) -> None:
        self.sort_column = COLUMNS[(COLUMNS.index(self.sort_column) + 1) % len(COLUMNS)]
        self.redraw()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self.redraw()

    def action_view(self, view: str) -> None:
        self.switcher.current = view
        if view in TABLE_OF_VIEW:
            self.query_one(TABLE_OF_VIEW[view]).focus()
        else:
            self.set_focus(None)
        self.redraw()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("visible")
        box.value = self.filter_text
        box.cursor_position = len(box.value)
        box.focus()

    def action_back(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("visible") or self.filter_text:
            self.filter_text = ""
            self._close_filter()
        elif self.view != "overview":
            self.action_view("overview")

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.redraw()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._close_filter()

    def _close_filter(self) -> None:
        self.query_one("#filter", Input).remove_class("visible")
        self.action_view(self.view)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if isinstance(event.data_table, RequestsTable):
            self.app.push_screen(DetailScreen(event.row_key.value))
