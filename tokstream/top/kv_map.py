"""The KV cache page map: every block a cell (free, in use coloured by its owner, cached
prefix, shared), or, when the pool outgrows the widget, each cell a range of blocks shaded by
how many of them are in use."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.cells import cell_len
from rich.text import Text
from textual.widget import Widget

from tokstream.core_state import Kv
from tokstream.top.view import PALETTE, owner_colour

FREE, CACHED, SHARED = "free", "cached", "shared"
GLYPH = {FREE: "·", CACHED: "▒", SHARED: "▓"}
COLOUR = {FREE: "#4b5263", CACHED: "#5fafaf", SHARED: "#ffffff"}
USED_GLYPH = "█"
SHADES = "▁▂▃▄▅▆▇█"
"""A range cell's glyph by the share of its blocks in use, in eighths (rounded up); unlike
the per-block glyphs, so a scaled map never reads as a cached or shared block."""


@dataclass
class Block:
    ref_count: int
    owner: str | None
    cached: bool

    @property
    def kind(self) -> str:
        """free, cached (nobody holds it, its prefix is kept), shared (held by more than one
        request), or the id of the one request holding it."""
        if self.ref_count == 0:
            return CACHED if self.cached else FREE
        return SHARED if self.ref_count > 1 else (self.owner or SHARED)


def blocks(kv: Kv) -> list[Block]:
    """Per block, from /v1/state's kv.block_map (ref-count characters, owner and cached runs)."""
    block_map = kv.block_map
    ref_counts = block_map.ref_counts
    owner: list[str | None] = [None] * len(ref_counts)
    for request_id, runs in block_map.owners.items():
        for first, count in runs:
            for block_id in range(first, min(first + count, len(owner))):
                owner[block_id] = owner[block_id] or request_id
    cached = [False] * len(ref_counts)
    for first, count in block_map.cached:
        for block_id in range(first, min(first + count, len(cached))):
            cached[block_id] = True
    return [Block(10 if c == "+" else int(c), o, k)
            for c, o, k in zip(ref_counts, owner, cached)]


def cells(pool: list[Block], capacity: int) -> tuple[int, list[tuple[str, str]]]:
    """(blocks per cell, [(glyph, colour)]) drawing pool in at most capacity cells."""
    if not pool or capacity <= 0:
        return 1, []
    per_cell = -(-len(pool) // capacity)
    if per_cell == 1:
        return 1, [(GLYPH.get(b.kind, USED_GLYPH), COLOUR.get(b.kind) or owner_colour(b.kind))
                   for b in pool]
    out = []
    for start in range(0, len(pool), per_cell):
        group = pool[start:start + per_cell]
        kinds = Counter(b.kind for b in group)
        used = len(group) - kinds[FREE] - kinds[CACHED]
        if used == 0:
            kind = CACHED if kinds[CACHED] else FREE
            out.append((GLYPH[kind], COLOUR[kind]))
            continue
        shade = SHADES[min(len(SHADES) - 1, -(-used * len(SHADES) // len(group)) - 1)]
        owners = Counter({k: n for k, n in kinds.items() if k not in (FREE, CACHED)})
        top_kind = owners.most_common(1)[0][0]
        out.append((shade, COLOUR.get(top_kind) or owner_colour(top_kind)))
    return per_cell, out


def legend_and_gauge(kv: Kv, pool: list[Block], width: int) -> Text:
    num_blocks = kv.num_blocks or len(pool)
    used = kv.used_blocks
    shared = sum(1 for b in pool if b.ref_count > 1)
    usage = used / num_blocks if num_blocks else 0.0
    text = Text()
    evictable = sum(1 for b in pool if b.kind == CACHED)
    text.append(f"KV {used}/{num_blocks} used  {kv.free_blocks} free ({evictable} "
                f"keep a cached prefix)  {kv.cached_blocks} cached  {shared} shared  ",
                style="bold")
    gauge_width = max(4, width - len(text) - 7)
    filled = round(usage * gauge_width)
    text.append("█" * filled, style="#e5c07b")
    text.append("░" * (gauge_width - filled), style="#4b5263")
    text.append(f" {usage:4.0%}")
    return text


class KvMap(Widget):
    """Draws the latest kv section of /v1/state to fit its size."""

    DEFAULT_CSS = "KvMap { width: 1fr; height: 1fr; min-height: 4; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.kv = Kv()

    def show(self, kv: Kv) -> None:
        self.kv = kv
        self.refresh()

    def render(self) -> Text:
        width, height = max(1, self.content_size.width), self.content_size.height
        pool = blocks(self.kv)
        text = legend_and_gauge(self.kv, pool, width)
        text.append("\n")
        for kind, label in ((FREE, "free"), (CACHED, "cached prefix"), (SHARED, "shared")):
            text.append(GLYPH[kind], style=COLOUR[kind]).append(f" {label}  ")
        text.append(USED_GLYPH, style=PALETTE[0]).append(" in use (request colour)")
        # Two passes: the note on a scaled map can itself take a line on a narrow widget.
        per_cell, drawn = cells(pool, width * max(0, height - _lines(text, width)))
        if per_cell > 1:
            text.append(f"  1 cell = {per_cell} blocks, {SHADES} by use")
            per_cell, drawn = cells(pool, width * max(0, height - _lines(text, width)))
        for index, (glyph, colour) in enumerate(drawn):
            if index % max(1, width) == 0:
                text.append("\n")
            text.append(glyph, style=colour)
        return text



def _lines(text: Text, width: int) -> int:
    """Terminal lines text takes at width, wrapping long lines."""
    return sum(max(1, -(-cell_len(line) // width)) for line in text.plain.split("\n"))
