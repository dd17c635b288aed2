"""What one `tokstream chaos EXPERIMENT` run is asked to do, checked on construction. Each
field's default is the one its flag shows (chaos/cli.py reads them from here), so a default is
stated once. Light on purpose: `tokstream --help` imports it."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from tokstream.errors import UserInputError

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def check_local(url: str) -> str:
    """Chaos sends real signals to the pids a server reports: only ever a local one."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UserInputError(f"--url must be http://HOST:PORT, not {url!r}")
    if parsed.hostname not in LOCAL_HOSTS:
        raise UserInputError(f"--url {url}: chaos only targets a server on this machine "
                             "(127.0.0.1 or localhost); it signals the server's processes")
    return url.rstrip("/")


@dataclass
class Options:
    experiment: str
    rank: int | None = None
    url: str | None = None
    admin_key: str | None = None
    api_key: str | None = None
    model: str = "smollm2"
    device: str = "cpu"
    dtype: str | None = None
    tp: int | None = None
    spare: bool = False
    streams: int | None = None
    max_tokens: int = 32
    repeat: int = 1
    seed: int = 0
    step_timeout_s: float = 10.0
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.repeat < 1:
            raise UserInputError(f"--repeat must be at least 1, not {self.repeat}")
        if self.streams is not None and self.streams < 2:
            raise UserInputError(f"--streams must be at least 2, not {self.streams}")
        if self.max_tokens < 8:
            raise UserInputError(f"--max-tokens must be at least 8, not {self.max_tokens}")
        if self.rank is not None and self.rank < 0:
            raise UserInputError(f"rank must be 0 or more, not {self.rank}")
        if self.url is None and (self.admin_key or self.api_key):
            raise UserInputError("--admin-key and --api-key go with --url (a server chaos "
                                 "starts gets keys of its own)")
        if self.url is not None:
            self.url = check_local(self.url)
