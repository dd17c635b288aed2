"""What one `tokstream chaos EXPERIMENT` run is asked to do, checked on construction. Each field
is its flag, stated once: chaos/cli.py generates the flags from the fields (tokstream/options.py:
the name, the type, the default, the docstring as help, an "envvar" in the metadata). Light on
purpose: `tokstream --help` imports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

from tokstream.config import SPECULATIVE_METHODS
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
    """One chaos run. Every field but experiment and rank is a flag of every experiment."""

    experiment: str
    """Which fault experiment (its subcommand's name, e.g. kill-rank)."""
    rank: int | None = None
    """Which rank (0-based)."""
    url: str | None = None
    """Target this running server (on this machine) instead of starting one."""
    admin_key: str | None = field(default=None, metadata={"envvar": "TOKSTREAM_ADMIN_KEY"})
    """With --url: the admin key for /v1/state and /v1/score."""
    api_key: str | None = field(default=None, metadata={"envvar": "TOKSTREAM_API_KEY"})
    """With --url: the key for the API routes (default: the admin key)."""
    model: str = "smollm2"
    """Model of the server chaos starts."""
    device: str = "cpu"
    """cpu or cuda (the server chaos starts)."""
    dtype: str | None = None
    """dtype of the server chaos starts (default auto)."""
    tp: int | None = None
    """Ranks of the server chaos starts (default: the smallest of at least 2 dividing the
    model's heads; 3 for SmolLM2)."""
    spare: bool = False
    """Start the server with warm spares (serve --spare --spare-core: a rank group and an
    engine core)."""
    speculative: str = "off"
    """Speculative decoding of the server chaos starts (serve --speculative's method, e.g.
    ngram)."""
    streams: int | None = None
    """Streams per round (default per experiment)."""
    max_tokens: int = 32
    """Output tokens of each decoding stream."""
    repeat: int = 1
    """Rounds in a row, one fault each."""
    seed: int = 0
    """Chooses the prompts, the seeds, which stream and which token index trigger the fault,
    who hangs up and when."""
    step_timeout_s: float = 10.0
    """Step deadline of the server chaos starts (what catches stall-rank)."""
    timeout_s: float = 600.0
    """Most seconds a round's streams may take."""

    def __post_init__(self):
        if self.repeat < 1:
            raise UserInputError(f"--repeat must be at least 1, not {self.repeat}")
        if self.streams is not None and self.streams < 2:
            raise UserInputError(f"--streams must be at least 2, not {self.streams}")
        if self.max_tokens < 8:
            raise UserInputError(f"--max-tokens must be at least 8, not {self.max_tokens}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise UserInputError(f"--speculative must be one of "
                                 f"{', '.join(SPECULATIVE_METHODS)}, not {self.speculative!r}")
        if self.rank is not None and self.rank < 0:
            raise UserInputError(f"rank must be 0 or more, not {self.rank}")
        if self.url is None and (self.admin_key or self.api_key):
            raise UserInputError("--admin-key and --api-key go with --url (a server chaos "
                                 "starts gets keys of its own)")
        if self.url is not None:
            self.url = check_local(self.url)
