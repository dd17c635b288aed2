"""The block map's cached runs that /v1/state carries for `tokstream top`, kept by the block
manager as blocks enter and leave the prefix cache (pure Python, no model)."""

from tokstream.engine.block_manager import BlockManager
from tokstream.engine.request import Request
from tokstream.sampling_params import SamplingParams


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=4, temperature=0), seed=0,
                   arrival=0.0)


def compute(manager: BlockManager, req: Request, num_tokens: int) -> None:
    """What a step does to a request's blocks: allocate, compute, register full blocks."""
    assert manager.allocate(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens
    manager.cache_full_blocks(req)


def test_cached_runs_follow_registration_sharing_eviction_and_reset():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 109))  # two full blocks and one partial
    first = request("a", prompt)
    compute(manager, first, 9)
    assert first.block_ids == [0, 1, 2] and manager.cached_runs == [[0, 2]]
    second = request("b", prompt)
    assert manager.match_prefix(second) == 8  # shares blocks 0 and 1
    compute(manager, second, 1)
    assert manager.ref_counts[:2] == [2, 2] and manager.cached_runs == [[0, 2]]
    other = request("c", list(range(500, 513)))
    compute(manager, other, 13)
    assert manager.cached_runs == [[0, 2], [4, 3]]
    manager.free(first)
    manager.free(second)
    # Nobody holds 0 and 1 now; they keep their prefix (evictable) and stay in the runs.
    assert manager.ref_counts[:2] == [0, 0] and manager.cached_runs == [[0, 2], [4, 3]]
    assert sum(n for _, n in manager.cached_runs) == manager.num_cached_blocks
    greedy = request("d", list(range(900, 948)))
    assert manager.allocate(greedy, 48) is not None  # every free block, then both cached ones
    assert 0 in greedy.block_ids and 1 in greedy.block_ids
    assert manager.cached_runs == [[4, 3]]  # the evicted blocks left the runs
    manager.free(greedy)
    manager.free(other)
    manager.reset()
    assert manager.cached_runs == [] and manager.num_cached_blocks == 0
