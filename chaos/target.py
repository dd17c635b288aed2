"""The server an experiment runs against: one it was pointed at (`--url`), or one it starts on
127.0.0.1 with a free port and a fresh admin key, and tears down on every exit path."""

from __future__ import annotations

import hashlib
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tokstream.errors import UserInputError
from tokstream.serve_process import ServeProcess

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0


@dataclass
class Target:
    url: str
    admin_key: str | None
    """Sent on admin routes (/v1/state, /v1/score)."""
    client_key: str | None
    """Sent on the API routes (a tenant key on a server with a tenants file)."""
    own: bool
    """True when the experiment started this server (and may send it signals)."""
    description: dict = field(default_factory=dict)

    def headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_key if admin else self.client_key
        return {"x-api-key": key, "authorization": f"Bearer {key}"} if key else {}


def default_tp(model: str) -> int:
    """The smallest tensor-parallel size of at least 2 that divides the model's query and KV
    heads (SmolLM2's 9 and 3: 3), so that a rank can die while the others hold their shards."""
    from tokstream.model.source import resolve_model

    config = resolve_model(model).config
    for tp in range(2, config.num_heads + 1):
        if config.num_heads % tp == 0 and config.num_kv_heads % tp == 0:
            return tp
    raise UserInputError(f"model {model}: no tensor-parallel size of 2 or more divides its "
                         f"{config.num_heads} query and {config.num_kv_heads} KV heads")


class OwnServer:
    """`with OwnServer(args) as target:` a `tokstream serve` child process, in its own session
    (Ctrl-C reaches only chaos, which then tears the server down in order), that also gets
    SIGTERM if chaos itself dies; stopped with SIGTERM, then whatever of its tree is left is
    SIGKILLed (tokstream.serve_process, the harness tests and benchmarks use too)."""

    def __init__(self, serve_args: list[str], env: dict[str, str] | None = None):
        self.serve_args = serve_args
        self.env = env
        self.server: ServeProcess | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="tokstream-chaos-")

    def __enter__(self) -> Target:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> Target:
        admin_key, client_key = (f"sk-chaos-{secrets.token_hex(16)}" for _ in range(2))
        tenants = Path(self._tmp.name) / "tenants.toml"
        tenants.write_text(f'admin_key_sha256 = "{_sha256(admin_key)}"\n\n[[tenant]]\n'
                           f'name = "chaos"\nkey_sha256 = "{_sha256(client_key)}"\n')
        self.server = ServeProcess(["--host", "127.0.0.1", "--port", "0", "--tenants",
                                    str(tenants), *self.serve_args], env=self.env,
                                   start_timeout_s=START_TIMEOUT_S, stop_timeout_s=STOP_TIMEOUT_S,
                                   new_session=True, keep_lines=200, reap=True)
        self.server.start()
        return Target(self.server.url, admin_key, client_key, own=True,
                      description={"command": " ".join(self.server.command[2:]),
                                   "pid": self.server.pid})

    def stop(self) -> None:
        """SIGTERM the gateway (it stops its engine core, which stops its ranks), then
        SIGKILL whatever of the tree is still there."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        self._tmp.cleanup()


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()
