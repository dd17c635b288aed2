"""Batch occupancy: running sequences against the cap and tokens in the last step against the
budget, each with a sparkline of the last minute; the waiting queue and preemptions."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from tokstream.top import format as fmt
from tokstream.top.view import History


def bar(value: float, limit: float | None, width: int) -> str:
    share = min(1.0, value / limit) if limit else 0.0
    filled = round(share * width)
    return "█" * filled + "░" * (width - filled)


class BatchPanel(Vertical):
    DEFAULT_CSS = """
    BatchPanel { width: 46; height: 100%; padding: 0 1; overflow: hidden hidden; }
    BatchPanel Sparkline { height: 2; margin-bottom: 1; }
    BatchPanel Static { height: 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="seqs")
        yield Sparkline([], id="seqs-line")
        yield Static(id="tokens")
        yield Sparkline([], id="tokens-line")
        yield Static(id="queue")
        yield Sparkline([], id="queue-line")

    def show(self, state: dict, history: History) -> None:
        batch = state.get("batch", {})
        running, max_seqs = batch.get("running", 0), batch.get("max_num_seqs")
        tokens, budget = batch.get("last_step_tokens", 0), batch.get("token_budget")
        self.query_one("#seqs", Static).update(
            f"{bar(running, max_seqs, 12)} [b]running[/b] {running}/{fmt.number(max_seqs)} seqs")
        self.query_one("#tokens", Static).update(
            f"{bar(tokens, budget, 12)} [b]step[/b] {tokens}/{fmt.number(budget)} tokens "
            f"{fmt.ms(batch.get('last_step_ms'))}")
        self.query_one("#queue", Static).update(
            f"[b]waiting[/b] {batch.get('waiting', 0)}  [b]preemptions[/b] "
            f"{batch.get('num_preemptions', 0)}  [b]step[/b] #{batch.get('step_id', 0)}")
        self.query_one("#seqs-line", Sparkline).data = history.series("running")
        self.query_one("#tokens-line", Sparkline).data = history.series("step_tokens")
        self.query_one("#queue-line", Sparkline).data = history.series("waiting")
