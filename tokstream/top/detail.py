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

from tokstream.state_snapshot import RequestDetail
from tokstream.top import format as fmt
from tokstream.top.source import SourceError
from tokstream.top.view import owner_colour


def describe(row: RequestDetail) -> Text:
    engine, params = row.engine, row.params
    text = Text()
    text.append(row.id, style="bold " + owner_colour(row.id))
    text.append(f"  tenant {row.tenant or '-'}  api {row.api or '-'}  state "
                f"{(engine.phase if engine else None) or row.state}  resumes {row.resumes}"
                f"  preemptions {engine.preemptions if engine else 0}\n")
    text.append(f"prompt {row.prompt_tokens} tokens  output {row.output_tokens}"
                f"/{row.max_tokens}  blocks {engine.blocks if engine else '-'}  TTFT "
                f"{fmt.ms(row.ttft_ms)}  ITL {fmt.ms(row.itl_ms)}  "
                f"{fmt.number(row.tokens_per_s, 1)} tok/s  age "
                f"{fmt.seconds(row.age_s)}  pending {row.pending_tokens}")
    drafted = engine.draft_tokens if engine else None
    if isinstance(drafted, int) and isinstance(engine.accepted_tokens, int):  # speculating
        share = f" ({engine.accepted_tokens / drafted:.0%})" if drafted else ""
        text.append(f"  drafted {fmt.number(drafted)} accepted "
                    f"{fmt.number(engine.accepted_tokens)}{share}")
    text.append("\n")
    text.append(f"temperature {params.temperature}  top_p {params.top_p}  top_k "
                f"{params.top_k}  seed {params.seed}  stop {params.stop}", style="dim")
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
        self.gone = False
        self.reading = False
        # Kept, not queried: a read may finish after Esc has closed the screen.
        self.fields = Static(Text(request_id, style="bold"), id="fields")
        self.notice = Static(id="notice")
        self.text = Static(id="text")
        self.scroll = VerticalScroll()

    def compose(self) -> ComposeResult:
        yield self.fields
        yield self.notice
        with self.scroll:
            yield self.text
        yield Footer()

    def on_mount(self) -> None:
        # Its own timer, at the app's interval: it stops when the screen closes.
        self.set_interval(self.app.interval_s, self.tick)
        self.tick()

    def tick(self) -> None:
        if not self.app.paused and not self.reading and not self.gone:
            self.run_worker(self.refresh_request())

    async def refresh_request(self) -> None:
        """Read the request once more."""
        self.reading = True
        try:
            row = await self.app.source.request(self.request_id)
        except SourceError as error:
            self.notice.update(Text(f"disconnected — retrying ({error})", style="bold #e06c75"))
            return
        finally:
            self.reading = False
        if row is None:
            self.gone = True
            self.notice.update(Text("finished: the server no longer has this request "
                                    "(its last text is below)", style="bold #e5c07b"))
            return
        self.notice.update(Text(f"text so far (last {len(row.recent_text)} "
                                "characters, live)", style="dim"))
        self.fields.update(describe(row))
        self.text.update(Text(row.recent_text))
        self.scroll.scroll_end(animate=False)
