"""What the engine offers the gateway, on dummy:tiny with real processes: the output digest
on the last delta, step stamps, the state snapshot and the score pass over the pipe."""

import asyncio

import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokstream.engine.async_engine import AsyncEngine
from tokstream.engine.messages.request import EngineRequest, token_digest
from tokstream.errors import UserInputError
from tokstream.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)


def tiny():
    # Speculation off: the hooks are checked one token a step.
    return EngineConfig(model="dummy:tiny", dtype="float32",
                        cache=CacheConfig(block_size=4, num_blocks=64),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256),
                        speculative=SpeculativeConfig(method="off"))


def test_token_digest_is_stable_and_order_sensitive():
    assert token_digest([1, 2, 3]) == token_digest([1, 2, 3])
    assert token_digest([1, 2, 3]) != token_digest([1, 3, 2])
    assert token_digest([]).startswith("sha256:")


@pytest.mark.startup
def test_digest_steps_snapshot_and_score():
    async def main():
        engine = await AsyncEngine(tiny()).start()
        try:
            greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            prompt = [5, 17, 99, 3, 8, 9]
            deltas = [d async for d in engine.generate(EngineRequest("a", prompt, greedy))]
            tokens = [t for d in deltas for t in d.token_ids]
            final = deltas[-1]
            assert final.output_digest == token_digest(tokens) and len(tokens) == 12
            steps = [d.step_id for d in deltas if d.token_ids]
            assert steps == list(range(steps[0], steps[0] + 12))
            assert final.queue_s is not None and final.queue_s >= 0

            # A snapshot while a request runs: rows, blocks and owners agree.
            long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            stream = engine.generate(EngineRequest("b", prompt, long))
            await stream.__anext__()
            snapshot = await engine.state()
            (row,) = snapshot["requests"]
            assert row["id"] == "b" and row["state"] == "running" and row["blocks"] > 0
            owners = snapshot["kv"]["block_map"]["owners"]["b"]
            assert sum(n for _, n in owners) == row["blocks"]
            assert snapshot["kv"]["used_blocks"] >= row["blocks"]
            assert snapshot["worker_pids"] and snapshot["pid"] == engine.pid
            await stream.aclose()

            # Teacher-forced scoring reproduces the greedy choices; blocks are returned.
            result = await engine.score(prompt + tokens, start=len(prompt))
            assert len(result.token_logits) == 12
            assert result.top_token_ids == tokens
            assert all(top - chosen < 1e-4 for top, chosen in
                       zip(result.top_logits, result.token_logits))
            with pytest.raises(UserInputError):
                await engine.score([1])
            with pytest.raises(UserInputError):
                await engine.score([1, 2, 3], start=5)
            for _ in range(100):
                snapshot = await engine.state()
                if not snapshot["requests"]:
                    break
                await asyncio.sleep(0.02)
            assert snapshot["kv"]["used_blocks"] == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())
