"""The `tokstream top` app: polls a source on an interval and draws each snapshot. The source
is injected (HttpSource against a server; tests give it a transport that replays recordings)."""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import ContentSwitcher, DataTable, Footer, Input

from tokstream.top.batch import BatchPanel
from tokstream.top.detail import DetailScreen
from tokstream.top.header import Header
from tokstream.top.help import HelpScreen
from tokstream.top.kv_map import KvMap
from tokstream.top.source import Frame, HttpSource, SourceError
from tokstream.top.tables import HEADINGS, EventsTable, RequestsTable, TenantsTable
from tokstream.top.view import COLUMNS, History, filter_rows, request_rows, sort_rows, \
    tenant_rows

VIEWS = ["overview", "requests", "cache", "tenants", "events"]
MAX_EVENTS = 500
NOTABLE_FINISHES = {"kv_cache_capacity"}
"""A request's end is logged only when it was cut short (it could never fit in the pool);
ordinary ends would drown the preemptions, rank deaths, restarts and refusals."""


class TopApp(App):
    TITLE = "tokstream top"
    CSS = """
    ContentSwitcher { height: 1fr; }
    #overview-top { height: 12; }
    RequestsTable { height: 1fr; }
    #filter { dock: bottom; display: none; }
    #filter.visible { display: block; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("p", "pause", "Pause"),
        Binding("s", "sort", "Sort"),
        Binding("r", "reverse", "Reverse"),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "back", "Back", show=False),
        *(Binding(str(n), f"view('{view}')", view.title(), show=False)
          for n, view in enumerate(VIEWS, 1)),
    ]

    def __init__(self, source: HttpSource, interval_s: float = 1.0):
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.frame: Frame | None = None
        self.history = History()
        self.events: dict[tuple, dict] = {}
        self.failures = 0
        self.error: str | None = None
        self.paused = False
        self.polling = False
        self.sort_column = "age_s"
        self.reverse = True
        self.filter_text = ""

    def compose(self) -> ComposeResult:
        yield Header(id="header")
        with ContentSwitcher(initial="overview"):
            with Vertical(id="overview"):
                with Horizontal(id="overview-top"):
                    yield KvMap(id="kv-small")
                    yield BatchPanel()
                yield RequestsTable(id="requests-small")
            yield RequestsTable(id="requests")
            yield KvMap(id="cache")
            yield TenantsTable(id="tenants")
            yield EventsTable(id="events")
        yield Input(placeholder="filter: id, tenant or state (Enter keeps it, Esc clears)",
                    id="filter", select_on_focus=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#requests-small").focus()
        self.redraw()
        self.set_interval(self.interval_s, self.tick)
        self.tick()

    async def on_unmount(self) -> None:
        await self.source.aclose()

    # --- polling ----------------------------------------------------------------------------

    def tick(self) -> None:
        if not self.paused and not self.polling:
            self.run_worker(self.poll_once(), group="poll")

    async def poll_once(self) -> None:
        """Read the server once and redraw; a failure shows as disconnected and the next
        tick tries again."""
        self.polling = True
        try:
            try:
                frame = await self.source.poll()
            except SourceError as error:
                self.failures += 1
                self.error = str(error)
            else:
                self.failures, self.error, self.frame = 0, None, frame
                self.history.add(frame)
                for event in frame.state.get("events", []):
                    if event.get("kind") == "finished" and \
                            event.get("reason") not in NOTABLE_FINISHES:
                        continue
                    key = (event.get("time"), event.get("kind"), event.get("request_id"))
                    self.events[key] = event
                for key in sorted(self.events, key=lambda k: k[0] or 0)[:-MAX_EVENTS]:
                    del self.events[key]
            self.redraw()
            if isinstance(self.screen, DetailScreen):
                await self.screen.refresh_request()
        finally:
            self.polling = False

    # --- drawing ----------------------------------------------------------------------------

    def notice(self) -> Text:
        if self.failures:
            return Text(f"disconnected — retrying every {self.interval_s:g} s "
                        f"({self.failures} failed: {self.error})", style="bold #e06c75")
        if self.paused:
            return Text("PAUSED — p resumes", style="bold reverse #e5c07b")
        if self.frame is None:
            return Text("connecting …", style="dim")
        rows = request_rows(self.frame.state)
        shown = filter_rows(rows, self.filter_text)
        text = Text(f"{len(rows)} requests", style="bold")
        if self.filter_text:
            text.append(f" ({len(shown)} match filter '{self.filter_text}')")
        text.append(f"  sort {HEADINGS[self.sort_column]} {'▼' if self.reverse else '▲'}"
                    f"  view {self.query_one(ContentSwitcher).current}   ? help",
                    style="dim")
        return text

    def redraw(self) -> None:
        state = self.frame.state if self.frame else {}
        self.query_one(Header).show(state, self.source.url, self.history.rate("prompt_tokens"),
                                    self.history.rate("output_tokens"), self.notice())
        if self.frame is None:
            return
        rows = sort_rows(filter_rows(request_rows(state), self.filter_text), self.sort_column,
                         self.reverse)
        for table in self.query(RequestsTable):
            table.show(rows, self.sort_column, self.reverse)
        for kv_map in self.query(KvMap):
            kv_map.show(state.get("kv", {}))
        self.query_one(BatchPanel).show(state, self.history)
        self.query_one(TenantsTable).show(tenant_rows(state))
        self.query_one(EventsTable).show(sorted(self.events.values(),
                                                key=lambda e: e.get("time") or 0))

    # --- keys -------------------------------------------------------------------------------

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.redraw()

    def action_sort(self) -> None:
        self.sort_column = COLUMNS[(COLUMNS.index(self.sort_column) + 1) % len(COLUMNS)]
        self.redraw()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self.redraw()

    def action_view(self, view: str) -> None:
        self.query_one(ContentSwitcher).current = view
        focus = {"overview": "#requests-small", "requests": "#requests",
                 "tenants": "#tenants", "events": "#events"}.get(view)
        if focus:
            self.query_one(focus).focus()
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
        elif self.query_one(ContentSwitcher).current != "overview":
            self.action_view("overview")

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.redraw()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._close_filter()

    def _close_filter(self) -> None:
        self.query_one("#filter", Input).remove_class("visible")
        self.action_view(self.query_one(ContentSwitcher).current)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if isinstance(event.data_table, RequestsTable):
            self.push_screen(DetailScreen(event.row_key.value))
