"""The /v1/state snapshot: the engine core's own (KV, batch, its rows and events) joined with
what only the gateway knows (streams, admission, tenants, replica status and restarts, ranks'
and processes' memory)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from tokstream.server import host_stats

if TYPE_CHECKING:
    from tokstream.server.state import Server


class GatewaySnapshot:
    def __init__(self):
        self.usage = host_stats.ProcessUsage()

    async def build(self, server: Server) -> dict:
        waited = time.perf_counter()
        core = await server.core_snapshot() or {}
        started = time.perf_counter()
        now = time.monotonic()
        engine = server.engine
        engine_rows = {row["id"]: row for row in core.get("requests", [])}
        requests = []
        for stream in server.registry.streams.values():
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
        worker_pids = engine.info.get("worker_pids") or core.get("worker_pids", [])
        roles = ([("gateway", os.getpid()), ("engine", engine.pid)]
                 + [(f"rank{rank}", pid) for rank, pid in enumerate(worker_pids)])
        usage = self.usage.measure([pid for _, pid in roles])
        ranks = [{"rank": rank, "pid": pid, "alive": host_stats.alive(pid), **usage[pid]}
                 for rank, pid in enumerate(worker_pids)]
        supervisor = server.supervisor
        return {
            "replica": {"status": server.status, "restarts": supervisor.total_restarts,
                        # rank: the rank group replaced by the core; core: the engine core
                        # process replaced by the gateway.
                        "restarts_by_kind": dict(supervisor.restarts),
                        "resumed_requests": dict(supervisor.resumed_requests),
                        "recovery_s": {k: list(v) for k, v in
                                       supervisor.recovery_seconds.items()},
                        "model": server.model_id, "dtype": engine.info.get("dtype"),
                        "device": engine.config.device, "tp": engine.config.tp,
                        "spare": engine.config.spare,
                        "max_model_len": server.max_model_len,
                        "uptime_s": time.time() - server.started,
                        "error": engine.dead},
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
            "admission": server.admission.snapshot(),
            "requests": requests,
            "tenants": [t.row() for t in server.tenants.tenants] if server.tenants else [],
            "fairness": core.get("tenants"),
            "events": server.events.merged(core.get("events", [])),
            "engine": {"pid": engine.pid, "alive": host_stats.alive(engine.pid)},
            "gateway": {"pid": os.getpid()},
            "memory": host_stats.memory(roles, usage, engine.config.device),
            "timing": {"core_wait_ms": (started - waited) * 1000,
                       "gateway_build_ms": (time.perf_counter() - started) * 1000},
        }
