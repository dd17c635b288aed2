"""A rollout without 503s (deploy/k8s/deployment.yaml's preStop): SIGUSR1 makes the replica
leave the pool, readiness 503 while every request is still served, so the endpoint picker
(which drops a pod only when its readiness fails) moves on before SIGTERM refuses new work.
The manifests' timings are checked in test_deploy_k8s.py."""

import signal
import time

import httpx
import pytest

from helpers.serving import ServerProcess, anthropic_body

pytestmark = [pytest.mark.startup, pytest.mark.timeout(180)]


def test_sigusr1_fails_readiness_and_keeps_serving_until_sigterm():
    with ServerProcess("--profile", "ci") as server:
        assert httpx.get(server.url + "/health/ready", timeout=10).status_code == 200
        server.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while (ready := httpx.get(server.url + "/health/ready", timeout=10)).status_code == 200:
            assert server.process.poll() is None, "SIGUSR1 stopped the server"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert ready.status_code == 503 and ready.json()["status"] == "leaving"
        assert httpx.get(server.url + "/health/live", timeout=10).status_code == 200
        # Whoever still routes here (the picker until it has seen the probe fail) is served.
        reply = httpx.post(server.url + "/v1/messages", timeout=60,
                           json=anthropic_body(max_tokens=2, stream=False))
        assert reply.status_code == 200, reply.text
        server.process.send_signal(signal.SIGUSR1)  # a second one changes nothing
        assert httpx.post(server.url + "/v1/messages", timeout=60, json=anthropic_body(
            max_tokens=2, stream=False)).status_code == 200
        # SIGTERM then drains as before: new work refused, then the process exits (uvicorn
        # re-raises the signal it caught, so the status is -SIGTERM).
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) in (0, -signal.SIGTERM)
