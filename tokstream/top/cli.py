"""`tokstream top`: a live TUI of a running server's KV pages, batch and streams."""

from typing import Optional
from urllib.parse import urlsplit

import typer

from tokstream.gateway_config import ServerConfig

DEFAULT_URL = f"http://{ServerConfig.host}:{ServerConfig.port}"
"""Where `tokstream serve` listens by default."""
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 3600.0
HTTP_TIMEOUT_S = 10.0
"""Per poll; /v1/state itself waits up to 5 s for a busy engine core between steps."""


def top(
    url: str = typer.Option(DEFAULT_URL, "--url", help="The server to watch."),
    admin_key: Optional[str] = typer.Option(
        None, "--admin-key", envvar="TOKSTREAM_ADMIN_KEY",
        help="Admin key, for servers with a tenants file (sent as x-api-key)."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between polls."),
):
    """A live TUI of a running server: KV cache pages, batch occupancy, per-request streams,
    tenants and events. Keys: q quit, ? help, p pause, s sort, r reverse, / filter, 1-5 views,
    Enter opens a request, Esc back."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        typer.echo(f"error: --url: expected http://HOST:PORT or https://…, got {url!r}", err=True)
        raise typer.Exit(2)
    if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
        typer.echo(f"error: --interval: must be between {MIN_INTERVAL_S:g} and "
                   f"{MAX_INTERVAL_S:g} seconds, got {interval:g}", err=True)
        raise typer.Exit(2)
    from tokstream.top.app import TopApp
    from tokstream.top.source import HttpSource

    TopApp(HttpSource(url, admin_key, HTTP_TIMEOUT_S), interval).run()
