"""The gateway's hub: the engine handle (through its supervisor), the stream registry and the
parts that share it (auth.py, submit.py, events.py, gateway_snapshot.py), and whether new work
is taken at all."""

from __future__ import annotations

import asyncio
import logging
import time

from tokstream.engine.async_engine import AsyncEngine
from tokstream.gateway_config import ServerConfig
from tokstream.server.access.gateway_admission import Admission
from tokstream.server.access.auth import Auth
from tokstream.server.api.conversation_store import ConversationStore
from tokstream.server.api_errors import ApiError, bad_request
from tokstream.server.operations.events import EventLog
from tokstream.server.operations.gateway_snapshot import GatewaySnapshot
from tokstream.server.operations.metrics import Metrics
from tokstream.server.operations.shared_snapshot import SharedSnapshot
from tokstream.server.streaming.streams import Stream, StreamRegistry
from tokstream.server.submit import Prompt, Submitter
from tokstream.server.replica.supervisor import EngineSupervisor
from tokstream.server.access.tenants import Tenant, Tenants, load_tenants
from tokstream.server.validation import shown
from tokstream.state_snapshot import ReplicaStatus, StateSnapshot
from tokstream.text.tokenizer import Tokenizer
from tokstream.text.tokenizer_pool import start_idle_pool

log = logging.getLogger("tokstream.server")

STATE_TIMEOUT_S = 5.0
"""How long /v1/state and /metrics wait for the core (it answers between steps)."""

__all__ = ["Prompt", "Server"]


class Server:
    def __init__(self, config: ServerConfig, engine: AsyncEngine, tokenizer: Tokenizer,
                 model_id: str, aliases: set[str]):
        self.config = config
        self.tokenizer = tokenizer
        if tokenizer is not None:  # before serving: building these holds the GIL
            start_idle_pool(tokenizer.backend)  # first, before any batch call starts the pool
            tokenizer.prepare_user_text()
            tokenizer.max_token_bytes  # worked out once, here (a read of the whole vocabulary)
        self.model_id = model_id
        self.model_names = {model_id} | aliases
        self.max_model_len: int = engine.info["max_model_len"]
        self.num_blocks: int = engine.info["num_blocks"]
        self.block_size: int = engine.info["block_size"]
        self.metrics = Metrics(model_id)
        self.admission = Admission(config.admission)
        self.tenants: Tenants | None = (load_tenants(config.tenants_file)
                                        if config.tenants_file else None)
        if self.tenants is not None:
            self.admission.set_weights({t.name: t.weight for t in self.tenants.tenants})
        self.auth = Auth(self.tenants)
        self.registry = StreamRegistry(engine, self.metrics, config.max_pending_tokens,
                                       config.slow_client_grace_s)
        if config.demux_mutation:
            from tokstream.chaos import demux_mutation  # test only: never loaded otherwise
            demux_mutation.install(self.registry, config.demux_mutation)
        self.events = EventLog()
        self.conversations = ConversationStore(config.conversation_store_bytes)
        """Kept conversations: stored Responses API responses, Messages API threads."""
        self.started = time.time()
        self.core_state = SharedSnapshot(lambda: self.engine.state(),
                                         timeout_s=STATE_TIMEOUT_S)
        """The core snapshot every reader shares (/metrics, /v1/state, top)."""
        asyncio.ensure_future(self.core_state.get())  # so the first reader (top) need not wait
        self.submitter = Submitter(self.registry, self.admission, self.metrics, self.events,
                                   on_change=self.core_state.invalidate)
        self.state_view = GatewaySnapshot()
        self.metrics.engine.status = ReplicaStatus.READY
        self.supervisor = EngineSupervisor(engine, self.registry, config.down_retry_s)
        self.supervisor.on_status = self._on_status
        self.supervisor.on_event = self.events.record
        self.supervisor.recovery.on_restart = self.metrics.on_restart
        self.draining = False
        """Set on SIGTERM (server/replica/drain.py): new requests are refused, open streams
        finish."""
        self.leaving = False
        """Set on SIGUSR1 (server/replica/drain.py): readiness fails, new requests are still
        served."""

    @property
    def engine(self) -> AsyncEngine:
        """The current engine (a new one after the engine core is restarted)."""
        return self.supervisor.engine

    @property
    def status(self) -> ReplicaStatus:
        """ready | recovering | down (see EngineSupervisor)."""
        return self.supervisor.status

    async def close(self) -> None:
        await self.supervisor.close()

    # --- model and limits -------------------------------------------------------------------

    def check_model(self, model) -> None:
        if not isinstance(model, str) or not model:
            raise bad_request("model", "must be a non-empty string")
        if model not in self.model_names:
            raise ApiError("not_found_error", f"model: {shown(model)} not found; this server serves "
                                              f"{self.model_id!r}", param="model")

    def check_ready(self) -> None:
        """Refuse new work when the replica is down or the server is draining for a shutdown.
        While it recovers, requests are taken (they wait in the admission queue, or in the
        registry while the engine core itself is replaced, and run once it is back)."""
        if self.draining:
            raise ApiError("overloaded_error", "server is shutting down; retry on another "
                           "replica or later", retry_after=5)
        if self.status == ReplicaStatus.DOWN:
            raise ApiError("overloaded_error", f"replica is {self.status}; retry later",
                           retry_after=max(1, self.config.down_retry_s))

    # --- submit -----------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: Prompt, tenant: Tenant | None,
               api: str, background: bool = False) -> Stream:
        """Admit and start a request; raises ApiError (429/529/503) when refused.
        background: below every interactive request (a Message Batch's)."""
        return self.submit_choices(request_id, [prompt], tenant, api, background)[0]

    def submit_choices(self, request_id: str, prompts: list[Prompt], tenant: Tenant | None,
                       api: str, background: bool = False) -> list[Stream]:
        """Admit a request once and start each prompt's n choices (see Submitter); raises
        ApiError (429/529/503) when refused."""
        self.check_ready()
        return self.submitter.submit_choices(request_id, prompts, tenant, api, background)

    def _on_status(self, status: str, reason: str | None) -> None:
        self.metrics.engine.status = status
        self.events.record(f"replica_{status}", reason=reason)

    # --- state ------------------------------------------------------------------------------

    async def core_snapshot(self, patience_s: float | None = None) -> dict | None:
        """The core's latest snapshot, shared; the previous one if the core is slow or gone
        (waiting at most patience_s: see SharedSnapshot.get)."""
        if self.engine.dead is None and not self.supervisor.replacing:
            await self.core_state.get(patience_s)
        self.metrics.engine.snapshot = self.core_state.value
        return self.core_state.value

    async def snapshot(self) -> StateSnapshot:
        """/v1/state (see gateway_snapshot.py)."""
        return await self.state_view.build(self)
