"""The `tokstream top` app: polls a source on an interval and has the screens draw each
snapshot. The source is injected (HttpSource against a server; tests give it a transport that
replays recordings)."""

from __future__ import annotations

from textual.app import App
from textual.binding import Binding

from tokstream.core_state import Event
from tokstream.top.help import HelpScreen
from tokstream.top.main_screen import MainScreen
from tokstream.top.source import Frame, HttpSource, SourceError
from tokstream.top.view import History

MAX_EVENTS = 500


class TopApp(App):
    TITLE = "tokstream top"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("p", "pause", "Pause"),
    ]

    def __init__(self, source: HttpSource, interval_s: float = 1.0):
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.frame: Frame | None = None
        self.history = History()
        self.events: dict[tuple, Event] = {}
        """Every event seen, by (time, kind, request id): the server keeps only its latest
        ones."""
        self.failures = 0
        """Polls failed in a row (0: connected)."""
        self.error: str | None = None
        self.paused = False
        self.polling = False
        self.main = MainScreen()

    def get_default_screen(self) -> MainScreen:
        return self.main

    def on_mount(self) -> None:
        self.set_interval(self.interval_s, self.tick)
        self.call_after_refresh(self.tick)  # once every widget is mounted

    async def on_unmount(self) -> None:
        await self.source.aclose()

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
                self._log_events(frame.state.events)
            self.main.redraw()
        finally:
            self.polling = False

    def _log_events(self, events: list[Event]) -> None:
        for event in events:
            self.events[(event.time, event.kind, event.request_id)] = event
        for key in sorted(self.events, key=lambda k: k[0] or 0)[:-MAX_EVENTS]:
            del self.events[key]

    def event_log(self) -> list[Event]:
        """The events seen so far, oldest first."""
        return sorted(self.events.values(), key=lambda e: e.time or 0)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.main.redraw()
