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

    def __init__(self):
        super().__init__()
        # Kept, not queried: a poll may land before this panel's children are mounted.
        self.seqs, self.tokens, self.queue = Static(), Static(), Static()
        self.seqs_line, self.tokens_line, self.queue_line = Sparkline(), Sparkline(), Sparkline()

    def compose(self) -> ComposeResult:
        yield from (self.seqs, self.seqs_line, self.tokens, self.tokens_line, self.queue,
                    self.queue_line)

    def show(self, state: dict, history: History) -> None:
        batch = state.get("batch", {})
        running, max_seqs = batch.get("running", 0), batch.get("max_num_seqs")
        tokens, budget = batch.get("last_step_tokens", 0), batch.get("token_budget")
        self.seqs.update(
            f"{bar(running, max_seqs, 12)} [b]running[/b] {running}/{fmt.number(max_seqs)} seqs")
        self.tokens.update(
            f"{bar(tokens, budget, 12)} [b]step[/b] {tokens}/{fmt.number(budget)} tokens "
            f"{fmt.ms(batch.get('last_step_ms'))}")
        self.queue.update(
            f"[b]waiting[/b] {batch.get('waiting', 0)}  [b]preemptions[/b] "
            f"{batch.get('num_preemptions', 0)}  [b]step[/b] #{batch.get('step_id', 0)}")
        self.seqs_line.data = history.series("running")
        self.tokens_line.data = history.series("step_tokens")
        self.queue_line.data = history.series("waiting")
