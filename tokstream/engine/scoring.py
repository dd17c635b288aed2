"""Teacher-forced scoring on the live engine: one pass over given tokens on blocks lent from the
pool, between steps. No torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokstream.engine import recovery
from tokstream.engine.messages import ScoreRequest, ScoreResult
from tokstream.engine.request import Request
from tokstream.errors import OverloadedError, PromptTooLongError, ReplicaError, UserInputError
from tokstream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokstream.engine.core import EngineCore


def score(core: EngineCore, token_ids: list[int], start: int = 1) -> ScoreResult:
    """Teacher-forced pass over token_ids on blocks lent from the pool: for positions
    start..n-1, the logit of the token there and the top logit, after the tokens before."""
    n = len(token_ids)
    if n < 2:
        raise UserInputError("token_ids: need at least 2 tokens to score")
    if not 1 <= start < n:
        raise UserInputError(f"start: must be in [1, {n - 1}], got {start}")
    vocab = core.model_config.vocab_size
    if any(not 0 <= t < vocab for t in token_ids):
        raise UserInputError(f"token_ids: every id must be in [0, {vocab})")
    if n > core.max_model_len:
        raise PromptTooLongError(f"token_ids: {n} tokens exceed the model's context of "
                                 f"{core.max_model_len}")
    if core.block_manager.blocks_for(n) > core.block_manager.num_blocks:
        raise UserInputError(f"token_ids: {n} tokens do not fit in the KV pool")
    borrower = Request("score", list(token_ids), SamplingParams(max_tokens=1), 0,
                       time.monotonic())
    block_ids = core.block_manager.allocate(
        borrower, n, reserve=core.config.scheduler.watermark_blocks)
    if block_ids is None:
        raise OverloadedError(f"KV pool busy: no room to score {n} tokens now")
    try:
        return core.executor.score(ScoreRequest(list(token_ids), block_ids, start))
    except ReplicaError as exc:
        core.block_manager.free(borrower)
        core.pending_deltas += recovery.recover(core, str(exc))
        raise OverloadedError(f"scoring interrupted by a rank failure: {exc}") from exc
    finally:
        if borrower.block_ids:
            core.block_manager.free(borrower)
