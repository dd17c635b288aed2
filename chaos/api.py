"""What chaos asks the server over HTTP: health, /v1/state, token counts and /v1/score."""

from __future__ import annotations

import asyncio
import time

import httpx

from tokstream.chaos.target import Target
from tokstream.state_snapshot import StateSnapshot

REQUEST_TIMEOUT_S = 120.0


class ServerAPI:
    def __init__(self, target: Target):
        self.target = target
        self.client = httpx.AsyncClient(base_url=target.url, timeout=REQUEST_TIMEOUT_S)

    async def close(self) -> None:
        await self.client.aclose()

    async def health(self) -> int:
        try:
            return (await self.client.get("/health")).status_code
        except httpx.HTTPError:
            return 0

    async def state(self) -> StateSnapshot:
        response = await self.client.get("/v1/state", headers=self.target.headers(admin=True))
        if response.status_code in (401, 403):
            raise PermissionError(f"/v1/state answered {response.status_code}: "
                                  f"{response.text[:200]} (is --admin-key right?)")
        response.raise_for_status()
        return StateSnapshot.from_wire(response.json())

    async def state_until(self, predicate, timeout_s: float, interval_s: float = 0.05
                          ) -> tuple[StateSnapshot, bool]:
        """(the first snapshot for which predicate holds, True), or (the last one, False)."""
        deadline = time.monotonic() + timeout_s
        while True:
            snapshot = await self.state()
            if predicate(snapshot):
                return snapshot, True
            if time.monotonic() > deadline:
                return snapshot, False
            await asyncio.sleep(interval_s)

    async def model_id(self) -> str:
        response = await self.client.get("/v1/models", headers=self.target.headers())
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    async def count_tokens(self, model: str, messages: list[dict]) -> int:
        response = await self.client.post("/v1/messages/count_tokens",
                                          headers=self.target.headers(),
                                          json={"model": model, "messages": messages})
        response.raise_for_status()
        return response.json()["input_tokens"]

    async def score(self, messages: list[dict], output_token_ids: list[int]) -> list[dict]:
        """Per output position: the chosen token's logit and the top logit, from one
        teacher-forced pass over the prompt the Anthropic route builds from messages."""
        response = await self.client.post("/v1/score", headers=self.target.headers(admin=True),
                                          json={"messages": messages,
                                                "output_token_ids": output_token_ids})
        response.raise_for_status()
        return response.json()["positions"]
