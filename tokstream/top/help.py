"""The help screen (`?`)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]tokstream top[/b] — a live view of a tokstream server

  [b]1[/b] overview   [b]2[/b] requests   [b]3[/b] KV cache   [b]4[/b] tenants   [b]5[/b] events
  [b]↑ ↓[/b]  move in the requests table     [b]Enter[/b]  open a request (its text, live)
  [b]s[/b]    cycle the sort column           [b]r[/b]      reverse the sort
  [b]/[/b]    filter requests (id, tenant or state contains every word; empty clears)
  [b]p[/b]    pause / resume polling          [b]Esc[/b]    back (closes a view, clears the filter)
  [b]?[/b]    this help                       [b]q[/b]      quit

KV map: [#4b5263]·[/] free  [#5fafaf]▒[/] cached prefix (nobody holds it)  [#ffffff]▓[/] shared (ref count > 1)
        [#e06c75]█[/] in use, in the colour of the request that holds it (its id has the same colour).
        A pool larger than the map is drawn with one cell per range of blocks, ▁▂▃▄▅▆▇█ by the share in use.
States: waiting, prefill, decode, preempted, recovering (paused by a replica restart, or
        re-prefilling after one), finishing (all tokens delivered), submitted (not yet in the engine).
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen Vertical { width: auto; height: auto; border: round $primary;
                          background: $surface; padding: 1 2; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)
