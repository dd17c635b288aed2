"""Batch occupancy: running sequences against the cap and tokens in the last step against the
budget, each with a sparkline of the last minute; the waiting queue and preemptions."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from tokstream.state_snapshot import StateSnapshot
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

    def show(self, state: StateSnapshot, history: History) -> None:
        batch = state.batch
        running, max_seqs = batch.running, batch.max_num_seqs
        tokens, budget = batch.last_step_tokens, batch.token_budget
        self.seqs.update(
            f"{bar(running, max_seqs, 12)} [b]running[/b] {running}/{fmt.number(max_seqs)} seqs")
        self.tokens.update(
            f"{bar(tokens, budget, 12)} [b]step[/b] {tokens}/{fmt.number(budget)} tokens "
            f"{fmt.ms(batch.last_step_ms)}")
        self.queue.update(
            f"[b]waiting[/b] {batch.waiting}  [b]preemptions[/b] "
            f"{batch.num_preemptions}  [b]step[/b] #{batch.step_id}")
        self.seqs_line.data = history.series("running")
        self.tokens_line.data = history.series("step_tokens")
        self.queue_line.data = history.series("waiting")
