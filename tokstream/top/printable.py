"""What `top` shows of text that callers control (a request's recent text, its stop strings,
ids, tenant names, event reasons): never a control character the operator's terminal would
act on.

A caller can make the model write exact bytes (a structured_outputs regex), ESC sequences
included, and /v1/state returns them as they are. Rich strips only a few control codes (BEL,
BS, VT, FF, CR), so an ESC, a CSI (U+009B) or an OSC reached the terminal through Textual:
a title change, a cleared screen, a hyperlink. Every string of every reply is made printable
once, where the source reads it (source.py), so no widget needs to remember to.
"""

from __future__ import annotations

import re

KEPT = "\n\t"
"""Control characters that are layout, not commands: kept."""
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
"""Bidirectional overrides and isolates: they reorder what the operator reads."""
_UNSAFE = re.compile("[" + "".join(
    chr(c) for c in [*range(0x20), 0x7f, *range(0x80, 0xa0)] if chr(c) not in KEPT)
    + BIDI + "]")


def printable(text: str) -> str:
    """text with every unsafe character written out as its escape (ESC -> \\x1b, U+202E ->
    \\u202e): visible, inert, and still telling the operator what was there."""
    return _UNSAFE.sub(lambda m: (f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                  else f"\\u{ord(m.group()):04x}"), text)


def printable_reply(value):
    """A decoded JSON reply with printable() applied to every string in it, keys included."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(k) if isinstance(k, str) else k: printable_reply(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [printable_reply(v) for v in value]
    return value
