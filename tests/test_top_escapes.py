"""`top` never hands a caller's control characters to the operator's terminal (issue 31): a
request whose text (a structured_outputs regex can force exact bytes), stop strings and
tenant carry ESC sequences, a C1 CSI and a bidi override is opened in the detail screen; what
the screen renders, and the bytes a full update would write, hold none of them, only their
visible escapes."""

from __future__ import annotations

import copy

from helpers.top_replay import FRAMES, Replay, first_poll, open_detail, replay_app
from test_top import SIZE, followed_request, run
from tokstream.top.printable import printable, printable_reply

HOSTILE = "ok\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b1m\u202etxt.exe\r\x08\x00end\n\tnext"
PAYLOADS = ("\x1b", "\x07", "\x9b", "\u202e", "\x00", "\x08")


def test_printable_writes_out_every_control_character_but_layout():
    assert printable(HOSTILE) == ("ok\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred\\x9b1m"
                                  "\\u202etxt.exe\\x0d\\x08\\x00end\n\tnext")
    assert printable("plain text, ünïcode ✓ 日本") == "plain text, ünïcode ✓ 日本"
    assert printable_reply({"a\x1b": ["\x1b", {"b": "\x07"}, 3, None]}) == \
        {"a\\x1b": ["\\x1b", {"b": "\\x07"}, 3, None]}


class HostileReplay(Replay):
    """The recording, with one request's text, stop strings and tenant made hostile."""

    def __init__(self, start: int, request_id: str):
        super().__init__(start)
        self.request_id = request_id

    @property
    def frame(self) -> dict:
        frame = copy.deepcopy(FRAMES[self.index])
        detail = frame["requests"].get(self.request_id)
        if detail is not None:
            detail["recent_text"] = HOSTILE
            detail["params"]["stop"] = [HOSTILE]
            detail["tenant"] = "t\x1b[8m"
        return frame


@run
async def test_the_detail_screen_renders_no_control_character():
    start, request_id, _ = followed_request()
    app = replay_app(HostileReplay(start, request_id))
    async with app.run_test(size=SIZE) as pilot:
        await first_poll(app, pilot)
        await open_detail(app, pilot, request_id)
        shown = str(app.screen.query_one("#text").render())
        fields = str(app.screen.query_one("#fields").render())
        assert shown == printable(HOSTILE) and "\\x1b]0;pwned" in shown
        assert "t\\x1b[8m" in fields and "\\x1b[2J" in fields
        for text in (shown, fields):
            assert not any(p in text for p in PAYLOADS), repr(text)
        # What the terminal would be sent for the whole screen: the app's own sequences,
        # never the caller's.
        update = app.screen._compositor.render_update(full=True)
        written = "".join(s.text for s in app.console.render(update))
        assert "\x1b]0;pwned" not in written
        assert "\\x1b]0;pwned" in written
        assert not any(p in written for p in ("\x07", "\x9b", "\u202e", "\x1b[2J", "\x1b[8m"))
