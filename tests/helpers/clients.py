"""What the client-library tests (tests/test_client_*.py) share: an environment in which no
client reaches past 127.0.0.1, and a recorder of the request bodies a client sends."""

from __future__ import annotations

import json

import httpx
import pytest

OFFLINE_ENV = {
    # Anything that tries the network outside loopback meets a dead proxy and fails at once,
    # instead of phoning home (telemetry, cost maps, tokenizer downloads).
    "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1", "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
    "LOGFIRE_SEND_TO_LOGFIRE": "false",
}


def offline(monkeypatch) -> None:
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)


class BodyRecorder:
    """An httpx event hook keeping the JSON body of every request a client sends
    (`httpx.Client(event_hooks={"request": [recorder]})`)."""

    def __init__(self):
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.read() or b"{}"))

    async def hook(self, request: httpx.Request) -> None:
        self(request)


@pytest.fixture(autouse=True)
def offline_env(monkeypatch):
    """Autouse in every test file that imports it: OFFLINE_ENV for each test."""
    offline(monkeypatch)


@pytest.fixture
def recorder() -> BodyRecorder:
    return BodyRecorder()
