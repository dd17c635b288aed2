"""One request, opened with Enter: its fields and its text as it streams, polled from
/v1/state/requests/{id} (the server keeps the last ~2,000 characters of each live request).
Esc goes back."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from tokstream.top import format as fmt
from tokstream.top.source import SourceError
from tokstream.top.view import owner_colour


def describe(row: dict) -> Text:
    engine = row.get("engine") or {}
    params = row.get("params") or {}
    text = Text()
    text.append(row["id"], style="bold " + owner_colour(row["id"]))
    text.append(f"  tenant {row.get('tenant') or '-'}  api {row.get('api', '-')}  state "
                f"{engine.get('phase') or row.get('state')}  resumes {row.get('resumes', 0)}"
                f"  preemptions {engine.get('preemptions', 0)}\n")
    text.append(f"prompt {row.get('prompt_tokens')} tokens  output {row.get('output_tokens')}"
                f"/{row.get('max_tokens')}  blocks {engine.get('blocks', '-')}  TTFT "
                f"{fmt.ms(row.get('ttft_ms'))}  ITL {fmt.ms(row.get('itl_ms'))}  "
                f"{fmt.number(row.get('tokens_per_s'), 1)} tok/s  age "
                f"{fmt.seconds(row.get('age_s'))}  pending {row.get('pending_tokens', 0)}\n")
    text.append(f"temperature {params.get('temperature')}  top_p {params.get('top_p')}  top_k "
                f"{params.get('top_k')}  seed {params.get('seed')}  stop {params.get('stop')}",
                style="dim")
    return text


class DetailScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]
    DEFAULT_CSS = """
    DetailScreen #fields { height: auto; background: $panel; padding: 0 1; }
    DetailScreen #notice { height: 1; padding: 0 1; }
    DetailScreen VerticalScroll { border: round $primary; padding: 0 1; }
    """

    def __init__(self, request_id: str):
        super().__init__()
        self.request_id = request_id
        self.row: dict | None = None
        self.gone = False

    def compose(self) -> ComposeResult:
        yield Static(Text(self.request_id, style="bold"), id="fields")
        yield Static(id="notice")
        with VerticalScroll():
            yield Static(id="text")
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(self.refresh_request())

    async def refresh_request(self) -> None:
        """Read the request once more; called by the app on every poll."""
        if self.gone:
            return
        try:
            row = await self.app.source.request(self.request_id)
        except SourceError as error:
            self.query_one("#notice", Static).update(
                Text(f"disconnected — retrying ({error})", style="bold #e06c75"))
            return
        notice = self.query_one("#notice", Static)
        if row is None:
            self.gone = True
            notice.update(Text("finished: the server no longer has this request "
                               "(its last text is below)", style="bold #e5c07b"))
            return
        self.row = row
        notice.update(Text(f"text so far (last {len(row.get('recent_text', ''))} characters, "
                           "live)", style="dim"))
        self.query_one("#fields", Static).update(describe(row))
        self.query_one("#text", Static).update(Text(row.get("recent_text", "")))
        self.query_one(VerticalScroll).scroll_end(animate=False)
