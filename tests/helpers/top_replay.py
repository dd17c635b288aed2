"""A fake tokstream server for `top`'s tests: answers /v1/state, /metrics and
/v1/state/requests/{id} from replies recorded off a real server under load
(tests/data/top/frames.json, made by tests/data/top/record.py), through an httpx transport, so
the app's real HTTP source reads them. `advance()` moves to the next recording; `down` makes
every request fail to connect, as a server that went away."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tokstream.top.app import TopApp
from tokstream.top.detail import DetailScreen
from tokstream.top.source import HttpSource
from tokstream.top.tables import RequestsTable

FRAMES = json.loads((Path(__file__).parents[1] / "data" / "top" / "frames.json").read_text())
URL = "http://replay.test:8000"


class Replay:
    def __init__(self, start: int = 0):
        self.index = start
        self.down = False
        self.paths: list[str] = []

    @property
    def frame(self) -> dict:
        return FRAMES[self.index]

    def advance(self) -> None:
        self.index = min(self.index + 1, len(FRAMES) - 1)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        path = request.url.path
        if path == "/v1/state":
            return httpx.Response(200, json=self.frame["state"])
        if path == "/metrics":
            return httpx.Response(200, text=self.frame["metrics"])
        request_id = path.removeprefix("/v1/state/requests/")
        if request_id in self.frame["requests"]:
            return httpx.Response(200, json=self.frame["requests"][request_id])
        return httpx.Response(404, json={"error": {"message": f"no live request {request_id}"}})


def replay_app(replay: Replay) -> TopApp:
    """The app on a replay; its timer never fires in a test (tests poll explicitly)."""
    source = HttpSource(URL, "sk-admin", transport=httpx.MockTransport(replay.handle))
    return TopApp(source, interval_s=3600)


async def first_poll(app: TopApp, pilot) -> None:
    """Wait for the poll the app starts once it is mounted."""
    for _ in range(200):
        if app.frame is not None or app.failures:
            break
        await pilot.pause(0.05)
    await app.workers.wait_for_complete()
    await pilot.pause()


async def open_detail(app: TopApp, pilot, request_id: str) -> DetailScreen:
    """Move the small requests table's cursor to `request_id` and open its detail screen."""
    table = app.main.query_one("#requests-small", RequestsTable)
    for _ in range(table.row_count):
        if table.selected_id == request_id:
            break
        await pilot.press("down")
    await pilot.press("enter")
    await app.workers.wait_for_complete()
    await pilot.pause()
    assert isinstance(app.screen, DetailScreen)
    return app.screen
