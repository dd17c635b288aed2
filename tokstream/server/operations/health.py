"""Liveness and readiness, for orchestrators: /health/live answers 200 whenever the gateway
answers (a recovering replica is alive: restarting it would only lose its streams);
/health/ready answers 200 only while new requests are welcome (503 while recovering, down,
draining for a shutdown, or leaving the pool after SIGUSR1: see server/replica/drain.py).
/health keeps its old meaning (200 ready, 503 recovering or down)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from tokstream.state_snapshot import ReplicaStatus


async def live(request):
    server = request.app.state.server
    return JSONResponse({"status": server.status, "draining": server.draining})


async def ready(request):
    server = request.app.state.server
    status = ("draining" if server.draining else "leaving" if server.leaving
              else server.status)
    ok = status == ReplicaStatus.READY
    return JSONResponse({"status": status}, status_code=200 if ok else 503,
                        headers=None if ok else {"retry-after": "5"})
