"""Teacher-forced scoring on the live engine: one pass over given tokens on blocks lent from the
pool, between steps. No torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokstream.engine.messages.worker import ScoreRequest, ScoreResult
from tokstream.engine.request import Request
from tokstream.errors import OverloadedError, PromptTooLongError, ReplicaError, UserInputError
from tokstream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokstream.engine.block_manager import BlockManager
    from tokstream.engine.executor import Executor


class Scorer:
    """Score passes on the core's rank group, on blocks lent from its block manager."""

    def __init__(self, executor: Executor, block_manager: BlockManager, vocab_size: int,
                 max_model_len: int, reserve_blocks: int,
                 on_rank_failure: Callable[[str], None]):
        self.executor = executor
        self.block_manager = block_manager
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.reserve_blocks = reserve_blocks
        """Blocks a pass leaves free (SchedulerConfig.watermark_blocks)."""
        self.on_rank_failure = on_rank_failure
        """Called with the reason when the rank group fails in a pass (the core recovers)."""

    def score(self, token_ids: list[int], start: int = 1) -> ScoreResult:
        """Teacher-forced pass over token_ids on blocks lent from the pool: for positions
        start..n-1, the logit of the token there and the top logit, after the tokens before."""
        n = len(token_ids)
        if n < 2:
            raise UserInputError("token_ids: need at least 2 tokens to score")
        if not 1 <= start < n:
            raise UserInputError(f"start: must be in [1, {n - 1}], got {start}")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise UserInputError(f"token_ids: every id must be in [0, {vocab})")
        if n > self.max_model_len:
            raise PromptTooLongError(f"token_ids: {n} tokens exceed the model's context of "
                                     f"{self.max_model_len}")
        manager = self.block_manager
        if manager.blocks_for(n) > manager.num_blocks:
            raise UserInputError(f"token_ids: {n} tokens do not fit in the KV pool")
        borrower = Request("score", list(token_ids), SamplingParams(max_tokens=1), 0,
                           time.monotonic())
        block_ids = manager.allocate(borrower, n, reserve=self.reserve_blocks)
        if block_ids is None:
            raise OverloadedError(f"KV pool busy: no room to score {n} tokens now")
        try:
            return self.executor.score(ScoreRequest(list(token_ids), block_ids, start))
        except ReplicaError as exc:
            manager.free(borrower)
            self.on_rank_failure(str(exc))
            raise OverloadedError(f"scoring interrupted by a rank failure: {exc}") from exc
        finally:
            if borrower.block_ids:
                manager.free(borrower)
