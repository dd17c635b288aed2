"""Submitting a validated request: admission (queue bounds, tenant reservations), a seed for
an unseeded request, one stream per choice, and settling the reservations once each ends."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from typing import Callable

from tokstream.checker import choice_request_id
from tokstream.engine.messages.request import FinishReason
from tokstream.errors import ReplicaError, UserInputError
from tokstream.sampling_params import SamplingParams
from tokstream.server.access.gateway_admission import Admission
from tokstream.server.api.choices import TenantShare, choice_params
from tokstream.server.api_errors import ApiError
from tokstream.server.operations.events import EventLog
from tokstream.server.operations.metrics import Metrics
from tokstream.server.streaming.streams import Stream, StreamRegistry
from tokstream.server.access.tenants import Tenant
from tokstream.server.api.echo import Echo
from tokstream.server.tool_calls.tools import ToolRequest

BACKGROUND_TIER = 1_000_000
"""Added to a background request's priority (a Message Batch's): in the engine's (priority,
arrival) order it comes after every interactive request, whatever their tenants' tiers, and is
preempted first."""


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
    echo: Echo | None = None
    """How a completion shows its prompt before the output (`echo`); None: it does not."""
    cache_salt: str = ""
    """The caller's own prefix-cache salt (vLLM's `cache_salt`): only requests with the same
    salt, of the same tenant, share cached blocks; "": the tenant's salt alone."""


class Submitter:
    """Admits requests and opens their streams, and settles what each reserved when it ends."""

    def __init__(self, registry: StreamRegistry, admission: Admission, metrics: Metrics,
                 events: EventLog, on_change: Callable[[], None]):
        self.registry = registry
        """The open streams; it calls back here when a stream has its first token, finishes or
        is cancelled (the hooks are set below)."""
        self.admission = admission
        """The bounded waiting queue: a request counts in it until its first token (or end)."""
        self.metrics = metrics
        """Where refusals, admissions, finishes and cancels are counted."""
        self.events = events
        """Where refused, cancelled and failed requests are recorded (/v1/state's events)."""
        self.on_change = on_change
        """Called when the set of requests changes (the shared core snapshot is then stale)."""
        self._tenant_of: dict[str, TenantShare] = {}
        """Each live stream's share of its tenant's reservation (one per request)."""
        self._seeds = random.SystemRandom()
        registry.on_finish = self._on_finish
        registry.on_cancel = self._on_cancel
        registry.on_first_token = self._leave_admission

    def submit_choices(self, request_id: str, prompts: list[Prompt], tenant: Tenant | None,
                       api: str, background: bool = False) -> list[Stream]:
        """Admit a request once and start each prompt's n choices, one stream each, indexed
        prompt by prompt (see server/api/choices.py); raises ApiError (429/529/503) when
        refused. background: below every interactive request (BACKGROUND_TIER)."""
        num_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        reserved = sum(prompt.n * prompt.params.max_tokens for prompt in prompts)
        try:
            self.admission.check(num_tokens, tenant.name if tenant else None, len(prompts))
            if tenant is not None:
                tenant.admit(num_tokens, reserved, background)
        except ApiError as error:
            self.metrics.errors.labels(error.error_type).inc()
            self.events.record("refused", request_id, reason=error.message,
                               tenant=tenant.name if tenant else None)
            raise
        # Drawn here, not by the core, so that a request resumed on a new core after the old
        # one died samples exactly as it would have on the old one.
        seed = self._seeds.getrandbits(63)
        # Tenants share the engine fairly by weight, in priority tiers, and never share
        # prefix-cache blocks (a cache hit would tell one tenant about another's prompts).
        fields = ({"tenant": tenant.name, "priority": tenant.priority,
                   "weight": tenant.weight} if tenant else {})
        if background:
            fields.update(priority=fields.get("priority", 0) + BACKGROUND_TIER, background=True)
        streams: list[Stream] = []
        try:
            for prompt in prompts:
                params = prompt.params
                if params.seed is None:
                    params = dataclasses.replace(params, seed=seed)
                salt = cache_salt(tenant.name if tenant else "", prompt.cache_salt)
                # The prompt's choices share its blocks (a group named by its first choice).
                group_id = choice_request_id(request_id, len(streams))
                group = {**fields, **({"cache_salt": salt} if salt else {}),
                         **({"prompt_group": group_id} if prompt.n > 1 else {})}
                for index in range(prompt.n):
                    streams.append(self.registry.open(
                        choice_request_id(request_id, len(streams)), prompt.token_ids,
                        choice_params(params, index), tenant.name if tenant else None, api,
                        bounded=prompt.stream, engine_fields=group))
        except (ReplicaError, UserInputError) as error:
            for stream in streams:
                self.registry.close(stream, "refused")
            if tenant is not None:
                tenant.settle(reserved, 0, background)
            raise ApiError("overloaded_error", str(error), retry_after=5) from error
        # Each prompt waits (and is counted) once, until its first choice's first token.
        for first in streams[::prompts[0].n]:
            self.admission.enter(first.num_prompt_tokens, tenant.name if tenant else None)
            first.in_admission = True
            self.metrics.on_admit(first)
        if tenant is not None:
            share = TenantShare(tenant, reserved, len(streams), background)
            for stream in streams:
                self._tenant_of[stream.request_id] = share
        self.on_change()
        return streams

    def _leave_admission(self, stream: Stream) -> None:
        if stream.in_admission:
            stream.in_admission = False
            waited = (stream.first_token_time - stream.arrival
                      if stream.first_token_time is not None else None)
            self.admission.leave(stream.num_prompt_tokens, waited, stream.tenant)

    def _on_finish(self, stream: Stream, delta) -> None:
        self._settle(stream, delta.num_output_tokens)
        self.metrics.on_finish(stream, delta, time.monotonic() - stream.arrival)
        if delta.finish_reason == FinishReason.ERROR:
            self.events.record("request_failed", stream.request_id, reason=delta.error)

    def _on_cancel(self, stream: Stream, reason: str) -> None:
        self._settle(stream, len(stream.delivered))
        self.metrics.cancels.labels(reason).inc()
        self.events.record("cancelled", stream.request_id, reason=reason)

    def _settle(self, stream: Stream, num_output_tokens: int) -> None:
        """Release a request's admission slot and tenant share, once."""
        self.on_change()
        self._leave_admission(stream)
        share = self._tenant_of.pop(stream.request_id, None)
        if share is not None:
            share.settle(num_output_tokens)


def cache_salt(tenant: str, caller: str) -> str:
    """The engine's salt for a tenant's request with the caller's own salt: the two kept
    apart (a plain join would let tenant "a:b" with salt "c" meet tenant "a" with "b:c")."""
    if not caller:
        return tenant
    return json.dumps([tenant, caller])
