"""The offline batch API for scripts: an in-process engine core driving a worker process.

    with LLM(EngineConfig(model="smollm2")) as llm:
        outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tokstream.config import EngineConfig
from tokstream.engine.core import EngineCore
from tokstream.engine.messages.request import EngineRequest, RequestDelta
from tokstream.engine.messages.worker import TokenLogprobs
from tokstream.sampling_params import SamplingParams


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Beside token_ids when the request asked for them (SamplingParams.logprobs)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """One per prompt token, the first None, when the request asked (SamplingParams.
    prompt_logprobs)."""


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = config or EngineConfig(**overrides)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.core.shutdown()

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def request(self, prompt: str | list[int], params: SamplingParams,
                chat: bool = False) -> EngineRequest:
        return EngineRequest(f"req-{next(self._ids)}", self.encode(prompt, chat), params)

    def stream(self, requests: Iterable[EngineRequest]) -> Iterator[RequestDelta]:
        """Submit every request, then step until all finish, yielding deltas as they come."""
        for request in requests:
            self.core.add_request(request)
        while self.core.has_work:
            yield from self.core.step()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 chat: bool = False) -> list[Completion]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        requests = [self.request(p, sp, chat) for p, sp in zip(prompts, params)]
        results = {r.request_id: Completion(r.request_id, r.prompt_token_ids) for r in requests}
        for delta in self.stream(requests):
            completion = results[delta.request_id]
            completion.token_ids.extend(delta.token_ids)
            completion.logprobs.extend(delta.logprobs or [])
            if delta.prompt_logprobs is not None:
                completion.prompt_logprobs = delta.prompt_logprobs
            completion.num_cached_tokens = delta.num_cached_tokens
            completion.text += delta.text
            if delta.finished:
                completion.finish_reason = delta.finish_reason
                completion.stop_reason = delta.stop_reason
        return [results[r.request_id] for r in requests]
