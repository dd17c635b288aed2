"""The gateway's configuration: where it binds, its limits and timeouts, what clients may do,
and its bounded admission queue. One dataclass per concern, validated on construction, as in
tokstream/config.py (whose BYTES metadata and field checks these share); `tokstream serve`'s
flags and the profiles' [server] and [admission] sections are generated from these fields."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from tokstream.config import BYTES, at_least_one
from tokstream.errors import UserInputError


@dataclass
class AdmissionConfig:
    """The gateway's bounded waiting queue (tokstream/server/access/gateway_admission.py)."""

    max_waiting_requests: int = 256
    """Admission: most requests waiting for their first token."""
    max_waiting_tokens: int = 262144
    """Admission: most prompt tokens over the requests waiting."""

    def __post_init__(self):
        at_least_one(self, "max_waiting_requests", "max_waiting_tokens")


@dataclass
class ServerConfig:
    """The gateway: bind, limits, timeouts, and what clients may do."""

    host: str = "127.0.0.1"
    """Address to bind; a non-loopback one needs a tenants file or insecure."""
    port: int = 8000
    """0 picks a free port (printed on the ready line)."""
    served_model_name: str | None = None
    """The model id clients send and /v1/models lists (default: the --model value)."""
    tenants_file: str | None = None
    """Tenants TOML file (API key hashes, limits, admin key)."""
    insecure: bool = False
    """Allow a non-loopback bind without API keys."""
    max_pending_tokens: int = 4096
    """A stream's unread tokens past which its request is cancelled (slow caller)."""
    slow_client_grace_s: float = 30.0
    """How long a caller may leave a send blocked (reading nothing) before it is cut off:
    after such a cancel, or with the request finished in the engine, whatever its state."""
    ping_interval_s: float = 5.0
    """Keep-alive on an idle stream (SSE ping), well under common 10 s proxy timeouts."""
    public_load_metrics: bool = False
    """With a tenants file, let a caller with no key read /metrics without the series that
    name tenants (queue, KV and latency: what the Gateway API endpoint picker reads, and it
    sends no credentials); a wrong key is still refused. Off: /metrics needs a key."""
    stream_integrity: bool = False
    """Frame every stream with the integrity extension's `id:` lines (and, on OpenAI routes,
    comment pings) even when the request does not ask (x-tokstream-integrity: 1): without it
    streams are framed exactly as the API they imitate, which stock clients parse."""
    max_body_bytes: int = field(default=4 * 2**20, metadata=BYTES)
    """Largest request body; larger ones get 413."""
    send_buffer_bytes: int | None = field(default=65536, metadata=BYTES)
    """SO_SNDBUF of client connections (the kernel doubles it).

    Token streams are a few KB/s each; a fixed buffer bounds kernel memory per connection and
    lets a caller that stopped reading show up as backpressure within a few hundred KB instead
    of after megabytes of autotuned buffer. None keeps the kernel's autotuning."""
    conversation_store_bytes: int = field(default=64 * 2**20, metadata=BYTES)
    """Most bytes of conversations kept in the gateway's memory, for the Responses API's
    previous_response_id and GET /v1/responses/{id} and the Messages API's threads: past it
    the tenant holding the most loses its oldest first. 0 keeps none (`store` is answered
    false, a `thread` refused)."""
    batch_concurrency: int = 8
    """Message Batches' requests in flight at once, over every batch: each runs below every
    interactive request (a lower priority tier) and its ended batch's results are kept
    within conversation_store_bytes. 0 refuses batches."""
    batch_dir: str | None = None
    """A folder where Message Batches are also kept on disk, so they outlive the gateway:
    at the next start the running ones go on and the ended ones are kept again. Unset: in
    memory only."""
    down_retry_s: float = 10.0
    """While the replica is down because engine cores keep failing to start, seconds between
    further tries."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM, how long open streams may run to their end (new requests are refused)
    before the rest end with an error event and the server stops."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host names clients may address besides loopback names and IP literals (a leading dot
    allows subdomains; "*" allows any). Others get 403: a web page that rebinds its own DNS
    name to this address cannot read the API."""
    allowed_origins: list[str] = field(default_factory=list)
    """Web origins whose pages may call the API (CORS); none by default, "*" for any."""
    header_timeout_s: float = 10.0
    """From a connection's first byte (or its previous response) to a complete request head;
    a client that takes longer is disconnected (slowloris)."""
    body_timeout_s: float = 30.0
    """Most seconds to receive a request body once its head is in."""
    max_connections: int = 0
    """Open client connections at most; past it a new one gets 503 and is closed. 0: the
    descriptor limit less descriptor_reserve."""
    descriptor_reserve: int = 128
    """File descriptors never given to client connections (engine pipes, restarts, logs)."""
    demux_mutation: str | None = None
    """TEST ONLY: corrupt one token in the demux (drop, repeat, swap, misroute, or a
    comma-separated sequence) to prove the integrity checker; refused with a tenants file or
    a non-loopback host."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self):
        self.allowed_hosts = _name_list(self.allowed_hosts, "allowed_hosts")
        self.allowed_origins = _name_list(self.allowed_origins, "allowed_origins")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise UserInputError("header_timeout_s and body_timeout_s must be > 0")
        if self.max_connections < 0 or self.descriptor_reserve < 0:
            raise UserInputError("max_connections and descriptor_reserve must be >= 0")
        if self.demux_mutation is not None and (self.tenants_file or not is_loopback(self.host)):
            raise UserInputError("demux_mutation is a test-only switch: refused with a tenants "
                                 "file or a non-loopback host")
        if not 0 <= self.port < 65536:
            raise UserInputError(f"port must be in [0, 65535], got {self.port}")
        at_least_one(self, "max_pending_tokens")
        if not self.ping_interval_s > 0:
            raise UserInputError("ping_interval_s must be > 0")
        if self.batch_concurrency < 0:
            raise UserInputError("batch_concurrency must be >= 0 (0 = refuse batches)")
        if self.conversation_store_bytes < 0:
            raise UserInputError("conversation_store_bytes must be >= 0 (0 = keep none)")
        if self.max_body_bytes < 1024:
            raise UserInputError("max_body_bytes must be >= 1024")
        if not self.down_retry_s > 0:
            raise UserInputError("down_retry_s must be > 0")
        if not self.shutdown_timeout_s >= 0:
            raise UserInputError("shutdown_timeout_s must be >= 0")

    def check_bind(self) -> None:
        """Refuse to expose an open (keyless) server beyond this machine unless told to."""
        if self.tenants_file or self.insecure or is_loopback(self.host):
            return
        raise UserInputError(
            f"refusing to bind {self.host} without API keys: pass --tenants FILE, or --insecure "
            "to serve an open endpoint on the network")


def _name_list(value, name: str) -> list[str]:
    """A comma-separated string (a flag) or a list of strings (a profile)."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise UserInputError(f"{name} must be a list of strings")
    return [v.strip().lower() for v in value if v.strip()]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
