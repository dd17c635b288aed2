"""The gateway's shared state: the engine handle, the stream registry, admission, tenants,
metrics, recent events; submitting a parsed request; and the /v1/state snapshot."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass

import psutil

from tokstream.checker import choice_request_id
from tokstream.engine.async_engine import AsyncEngine
from tokstream.errors import ReplicaError, UserInputError
from tokstream.sampling_params import SamplingParams
from tokstream.server.admission import Admission
from tokstream.server.choices import TenantShare, choice_params
from tokstream.config import ServerConfig
from tokstream.server.errors import ApiError
from tokstream.server.metrics import Metrics
from tokstream.server.snapshot import SharedSnapshot
from tokstream.server.streams import Stream, StreamRegistry
from tokstream.server.supervisor import EngineSupervisor
from tokstream.server.tenants import Tenant, Tenants, load_tenants
from tokstream.server.tools import ToolRequest
from tokstream.tokenizer import Tokenizer

log = logging.getLogger("tokstream.server")

MAX_EVENTS = 128
STATE_TIMEOUT_S = 5.0
"""How long /v1/state and /metrics wait for the core (it answers between steps)."""


@dataclass
class Prompt:
    """A validated request, ready for admission."""

    token_ids: list[int]
    params: SamplingParams
    stream: bool
    tools: ToolRequest | None = None
    """The functions the model may call (its output is then parsed for calls)."""
    n: int = 1
    """Choices to generate from the prompt (OpenAI's `n`)."""


class Server:
    def __init__(self, config: ServerConfig, engine: AsyncEngine, tokenizer: Tokenizer,
                 model_id: str, aliases: set[str]):
        self.config = config
        self.tokenizer = tokenizer
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
        self.registry = StreamRegistry(engine, self.metrics, config.max_pending_tokens,
                                       config.slow_client_grace_s, config.demux_mutation)
        self.registry.on_finish = self._on_finish
        self.registry.on_cancel = self._on_cancel
        self.registry.on_first_token = self._on_first_token
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self.started = time.time()
        self._tenant_of: dict[str, TenantShare] = {}
        """Each live stream's share of its tenant's reservation (one per request)."""
        self.core_state = SharedSnapshot(lambda: self.engine.state(),
                                         timeout_s=STATE_TIMEOUT_S)
        """The core snapshot every reader shares (/metrics, /v1/state, top)."""
        asyncio.ensure_future(self.core_state.get())  # so the first reader (top) need not wait
        self._seeds = random.SystemRandom()
        self._processes: dict[int, psutil.Process] = {}
        """pid -> Process, kept between snapshots: CPU percent is measured since the last call."""
        self.metrics.engine.status = "ready"
        self.supervisor = EngineSupervisor(engine, self.registry, config.down_retry_s)
        self.supervisor.on_status = self._on_status
        self.supervisor.on_event = self.event
        self.supervisor.on_restart = self.metrics.on_restart
        self.draining = False
        """Set on SIGTERM (server/drain.py): new requests are refused, open streams finish."""

    @property
    def engine(self) -> AsyncEngine:
        """The current engine (a new one after the engine core is restarted)."""
        return self.supervisor.engine

    @property
    def status(self) -> str:
        """ready | recovering | down (see EngineSupervisor)."""
        return self.supervisor.status

    async def close(self) -> None:
        await self.supervisor.close()

    # --- auth -------------------------------------------------------------------------------

    @staticmethod
    def presented_key(headers) -> str | None:
        key = headers.get("x-api-key")
        if key:
            return key
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def authenticate(self, headers) -> Tenant | None:
        if self.tenants is None:
            return None
        return self.tenants.authenticate(self.presented_key(headers))

    def authenticate_admin(self, headers) -> None:
        if self.tenants is not None:
            self.tenants.authenticate_admin(self.presented_key(headers))

    def authenticate_metrics(self, headers) -> None:
        if self.tenants is not None:
            self.tenants.authenticate_metrics(self.presented_key(headers))

    # --- model and limits -------------------------------------------------------------------

    def check_model(self, model) -> None:
        if not isinstance(model, str) or not model:
            from tokstream.server.errors import bad_request
            raise bad_request("model", "must be a non-empty string")
        if model not in self.model_names:
            from tokstream.server.validation import shown
            raise ApiError("not_found_error", f"model: {shown(model)} not found; this server serves "
                                              f"{self.model_id!r}", param="model")

    def check_ready(self) -> None:
        """Refuse new work when the replica is down or the server is draining for a shutdown.
        While it recovers, requests are taken (they wait in the admission queue, or in the
        registry while the engine core itself is replaced, and run once it is back)."""
        if self.draining:
            raise ApiError("overloaded_error", "server is shutting down; retry on another "
                           "replica or later", retry_after=5)
        if self.status == "down":
            raise ApiError("overloaded_error", f"replica is {self.status}; retry later",
                           retry_after=max(1, self.config.down_retry_s))

    # --- submit -----------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: Prompt, tenant: Tenant | None,
               api: str) -> Stream:
        """Admit and start a request; raises ApiError (429/529/503) when refused."""
        return self.submit_choices(request_id, prompt, tenant, api)[0]

    def submit_choices(self, request_id: str, prompt: Prompt, tenant: Tenant | None,
                       api: str) -> list[Stream]:
        """Admit a request once and start its prompt.n choices, one stream each (see
        server/choices.py); raises ApiError (429/529/503) when refused."""
        self.check_ready()
        n = len(prompt.token_ids)
        reserved = prompt.n * prompt.params.max_tokens
        try:
            self.admission.check(n, tenant.name if tenant else None)
            if tenant is not None:
                tenant.admit(n, reserved)
        except ApiError as error:
            self.metrics.errors.labels(error.error_type).inc()
            self.event("refused", request_id, reason=error.message,
                       tenant=tenant.name if tenant else None)
            raise
        params = prompt.params
        if params.seed is None:
            # Drawn here, not by the core, so that a request resumed on a new core after the
            # old one died samples exactly as it would have on the old one.
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        # Tenants share the engine fairly by weight, in priority tiers, and never share
        # prefix-cache blocks (a cache hit would tell one tenant about another's prompts).
        fields = ({"tenant": tenant.name, "priority": tenant.priority,
                   "weight": tenant.weight, "cache_salt": tenant.name} if tenant else {})
        if prompt.n > 1:
            fields["prompt_group"] = request_id
        streams: list[Stream] = []
        try:
            for index in range(prompt.n):
                streams.append(self.registry.open(
                    choice_request_id(request_id, index), prompt.token_ids,
                    choice_params(params, index), tenant.name if tenant else None, api,
                    bounded=prompt.stream, engine_fields=fields))
        except (ReplicaError, UserInputError) as error:
            for stream in streams:
                self.registry.close(stream, "refused")
            if tenant is not None:
                tenant.settle(reserved, 0)
            raise ApiError("overloaded_error", str(error), retry_after=5) from error
        # The prompt waits (and is counted) once, until the first choice's first token.
        self.admission.enter(n, tenant.name if tenant else None)
        streams[0].in_admission = True
        if tenant is not None:
            share = TenantShare(tenant, reserved, prompt.n)
            for stream in streams:
                self._tenant_of[stream.request_id] = share
        self.metrics.on_admit(streams[0])
        self.core_state.invalidate()
        return streams

    def _on_first_token(self, stream: Stream) -> None:
        self._leave_admission(stream)

    def _leave_admission(self, stream: Stream) -> None:
        if stream.in_admission:
            stream.in_admission = False
            waited = (stream.first_token_time - stream.arrival
                      if stream.first_token_time is not None else None)
            self.admission.leave(stream.num_prompt_tokens, waited, stream.tenant)

    def _on_finish(self, stream: Stream, delta) -> None:
        self._settle(stream, delta.num_output_tokens)
        self.metrics.on_finish(stream, delta, time.monotonic() - stream.arrival)
        if delta.finish_reason == "error":
            self.event("request_failed", stream.request_id, reason=delta.error)

    def _on_cancel(self, stream: Stream, reason: str) -> None:
        self._settle(stream, len(stream.delivered))
        self.metrics.cancels.labels(reason).inc()
        self.event("cancelled", stream.request_id, reason=reason)

    def _settle(self, stream: Stream, num_output_tokens: int) -> None:
        """Release a request's admission slot and tenant share, once."""
        self.core_state.invalidate()
        self._leave_admission(stream)
        share = self._tenant_of.pop(stream.request_id, None)
        if share is not None:
            share.settle(num_output_tokens)

    def event(self, kind: str, request_id: str | None = None, **fields) -> None:
        self.events.append({"time": time.time(), "kind": kind, "request_id": request_id,
                            **fields})

    def _on_status(self, status: str, reason: str | None) -> None:
        self.metrics.engine.status = status
        self.event(f"replica_{status}", reason=reason)

    # --- state ------------------------------------------------------------------------------

    async def core_snapshot(self) -> dict | None:
        """The core's latest snapshot, shared; the previous one if the core is slow or gone."""
        if self.engine.dead is None and not self.supervisor.replacing:
            await self.core_state.get()
        self.metrics.engine.snapshot = self.core_state.value
        return self.core_state.value

    async def snapshot(self) -> dict:
        waited = time.perf_counter()
        core = await self.core_snapshot() or {}
        started = time.perf_counter()
        now = time.monotonic()
        engine_rows = {row["id"]: row for row in core.get("requests", [])}
        requests = []
        for stream in self.registry.streams.values():
            row = stream.row(now)
            engine_row = engine_rows.get(stream.request_id, {})
            row["state"] = engine_row.get("state", "finishing" if stream.final else "submitted")
            row["blocks"] = engine_row.get("blocks", 0)
            row["preemptions"] = engine_row.get("preemptions", 0)
            row["computed_tokens"] = engine_row.get("computed_tokens")
            row["phase"] = engine_row.get("phase", row["state"])
            requests.append(row)
        kv = dict(core.get("kv", {}))
        last = core.get("last_step") or {}
        # The current group's ranks (the core's snapshot may predate a restart).
        worker_pids = self.engine.info.get("worker_pids") or core.get("worker_pids", [])
        roles = ([("gateway", os.getpid()), ("engine", self.engine.pid)]
                 + [(f"rank{rank}", pid) for rank, pid in enumerate(worker_pids)])
        usage = self._usage([pid for _, pid in roles])
        ranks = [{"rank": rank, "pid": pid, "alive": _alive(pid), **usage[pid]}
                 for rank, pid in enumerate(worker_pids)]
        supervisor = self.supervisor
        events = sorted(list(self.events) + [
            {**e, "source": "engine"} for e in core.get("events", [])],
            key=lambda e: e["time"])[-MAX_EVENTS:]
        return {
            "replica": {"status": self.status, "restarts": supervisor.total_restarts,
                        # rank: the rank group replaced by the core; core: the engine core
                        # process replaced by the gateway.
                        "restarts_by_kind": dict(supervisor.restarts),
                        "resumed_requests": dict(supervisor.resumed_requests),
                        "recovery_s": {k: list(v) for k, v in
                                       supervisor.recovery_seconds.items()},
                        "model": self.model_id, "dtype": self.engine.info.get("dtype"),
                        "device": self.engine.config.device, "tp": self.engine.config.tp,
                        "spare": self.engine.config.spare,
                        "max_model_len": self.max_model_len,
                        "uptime_s": time.time() - self.started,
                        "error": self.engine.dead},
            "ranks": ranks,
            "kv": kv,
            "batch": {"running": core.get("running", 0), "waiting": core.get("waiting", 0),
                      "max_num_seqs": core.get("max_num_seqs"),
                      "token_budget": core.get("token_budget"),
                      "last_step_tokens": last.get("num_tokens", 0),
                      "last_step_seqs": last.get("num_seqs", 0),
                      "last_step_ms": last.get("step_ms"),
                      "step_id": core.get("step_id", 0),
                      "num_preemptions": core.get("num_preemptions", 0),
                      **{key: core[key] for key in (
                          "chunked_prefill", "max_prefill_chunk", "preemption_mode",
                          "num_swap_preemptions", "policy", "prefill_tokens_total",
                          "decode_tokens_total") if key in core}},
            "admission": self.admission.snapshot(),
            "requests": requests,
            "tenants": [t.row() for t in self.tenants.tenants] if self.tenants else [],
            "fairness": core.get("tenants"),
            "events": events,
            "engine": {"pid": self.engine.pid, "alive": _alive(self.engine.pid)},
            "gateway": {"pid": os.getpid()},
            "memory": _memory(roles, usage, self.engine.config.device),
            "timing": {"core_wait_ms": (started - waited) * 1000,
                       "gateway_build_ms": (time.perf_counter() - started) * 1000},
        }


    def _usage(self, pids: list[int | None]) -> dict:
        """pid -> {"rss_bytes", "cpu_percent"} (None where unknown; CPU percent of one core
        since the previous snapshot, None on a process's first)."""
        self._processes = {pid: process for pid, process in self._processes.items()
                           if pid in pids}
        usage = {}
        for pid in pids:
            usage[pid] = {"rss_bytes": None, "cpu_percent": None}
            if not pid:
                continue
            try:
                process = self._processes.get(pid)
                first = process is None
                if first:
                    process = self._processes[pid] = psutil.Process(pid)
                with process.oneshot():
                    usage[pid] = {"rss_bytes": process.memory_info().rss,
                                  "cpu_percent": None if first else process.cpu_percent()}
                    if first:
                        process.cpu_percent()  # the baseline for the next snapshot
            except psutil.Error:
                self._processes.pop(pid, None)
        return usage


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _memory(processes: list[tuple[str, int | None]], usage: dict, device: str) -> dict:
    host = psutil.virtual_memory()
    rows = [{"role": role, "pid": pid, **usage[pid]} for role, pid in processes]
    return {"host": {"total_bytes": host.total, "available_bytes": host.available,
                     "cpu_count": psutil.cpu_count()},
            "processes": rows, "devices": _device_memory() if device == "cuda" else []}


def _device_memory() -> list[dict]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append({"index": index, "total_bytes": info.total, "used_bytes": info.used,
                        "utilization_percent": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu})
        return out
    except pynvml.NVMLError:
        return []
