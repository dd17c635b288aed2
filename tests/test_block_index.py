"""The block index an engine core leaves in the gateway's files (engine/recovery/block_index.py)
and the next core adopts (BlockManager.attach_index), pure Python: what claim keeps and what it
starts afresh, and a property test over random add / abort / step / recover / core-death
sequences against a simulated pool, in which no request ever attends to a slot holding
anything but its own tokens' KV, across core deaths included."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokstream.engine.recovery.block_index import BlockIndex, layout_signature
from tokstream.engine.recovery.pool_adoption import PoolAdoption
from tokstream.engine.block_manager import BlockManager
from tokstream.engine.recovery.pool_files import PoolFiles, PoolPaths
from tokstream.engine.request import RequestStatus
from test_block_check import apply
from test_scheduler import make_request, make_scheduler

SIGNATURE = layout_signature("test layout", 4)


@pytest.fixture
def index_path():
    files = PoolFiles(tp=1)
    yield files.paths().index
    files.close()


def test_claim_keeps_what_was_listed_for_the_same_layout_only(index_path):
    first = BlockIndex(index_path)
    assert first.claim(SIGNATURE, 8) == {}
    first.publish(3, b"h" * 16)
    first.publish(5, b"k" * 16)
    first.clear(5)
    first.close()
    assert BlockIndex(index_path).claim(SIGNATURE, 8) == {3: b"h" * 16}
    assert BlockIndex(index_path).claim(layout_signature("another", 4), 8) == {}
    # ... and the other layout's claim emptied it for good.
    assert BlockIndex(index_path).claim(SIGNATURE, 8) == {}
    again = BlockIndex(index_path)
    again.claim(SIGNATURE, 8)
    again.publish(1, b"z" * 16)
    assert BlockIndex(index_path).claim(SIGNATURE, 9) == {}  # another pool size


def served(manager, request):
    """request computed to its end, its full blocks cached (what a step does)."""
    manager.match_prefix(request)
    manager.allocate(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


def test_a_new_manager_adopts_the_cached_blocks_and_finds_them_by_prefix(index_path):
    old = BlockManager(16, 4)
    index = BlockIndex(index_path)
    assert old.attach_index(index, index.claim(SIGNATURE, 16)) == 0
    a = make_request("a", prompt=list(range(100, 113)), salt="t1")
    served(old, a)
    assert old.check([a]) == [] and len(index.entries()) == 3
    # The old core dies; the new one claims the index.
    new = BlockManager(16, 4)
    index2 = BlockIndex(index_path)
    assert new.attach_index(index2, index2.claim(SIGNATURE, 16)) == 3
    assert new.num_cached_blocks == 3 and new.num_free_blocks == 16
    again = make_request("a2", prompt=list(range(100, 113)) + [5], salt="t1")
    assert new.match_prefix(again) == 12 and again.block_ids == a.block_ids[:3]
    other_tenant = make_request("b", prompt=list(range(100, 113)), salt="t2")
    assert new.match_prefix(other_tenant) == 0
    assert new.check([again, other_tenant]) == []


def test_a_manager_that_handed_out_a_block_adopts_nothing(index_path):
    old = BlockManager(16, 4)
    index = BlockIndex(index_path)
    old.attach_index(index, index.claim(SIGNATURE, 16))
    served(old, make_request("a", prompt=list(range(100, 113))))
    new = BlockManager(16, 4)
    b = make_request("b", prompt=[200, 201, 202])
    served(new, b)  # it wrote into a block the index may list (too short to cache)
    index2 = BlockIndex(index_path)
    assert new.attach_index(index2, index2.claim(SIGNATURE, 16)) == 0
    assert new.check([b]) == []  # the index now lists this manager's cache, nothing else


def test_the_self_check_sees_an_index_that_disagrees(index_path):
    manager = BlockManager(16, 4)
    index = BlockIndex(index_path)
    manager.attach_index(index, index.claim(SIGNATURE, 16))
    a = make_request("a", prompt=list(range(100, 113)))
    served(manager, a)
    index.clear(a.block_ids[0])
    assert any("block index" in p for p in manager.check([a]))


# --- the property test ------------------------------------------------------------------------

class Pool:
    """What the ranks would have written: each slot names the tokens whose KV it holds (its
    token and every one before it)."""

    def __init__(self, num_blocks, block_size, host_blocks):
        self.block_size = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(host_blocks)]

    def run(self, out):
        """A step as a rank runs it: swaps, then every chunk's KV written; first, every chunk
        attends only to slots holding its own tokens' KV."""
        for pool_block, host_block in out.swap_out:
            self.host[host_block] = list(self.slots[pool_block])
        for host_block, pool_block in out.swap_in:
            self.slots[pool_block] = list(self.host[host_block])
        bs = self.block_size
        for work in out.work:
            request = work.request
            for position in range(work.start):
                block = request.block_ids[position // bs]
                assert self.slots[block][position % bs] == tuple(
                    request.token_slice(0, position + 1)), (request.request_id, position)
            for position in range(work.start, work.start + work.num_tokens):
                block = request.block_ids[position // bs]
                self.slots[block][position % bs] = tuple(request.token_slice(0, position + 1))


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 20), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("recover")),
    st.tuples(st.just("die"), st.booleans()),
), min_size=1, max_size=60)


def new_core(index_path, chunked, swap, budget):
    s = make_scheduler(num_blocks=12, budget=budget, chunked_prefill=chunked,
                       swap_blocks=6 if swap else None)
    index = BlockIndex(index_path)
    s.block_manager.attach_index(index, index.claim(SIGNATURE, 12))
    return s


def test_a_block_handed_out_again_is_unlisted_before_its_new_owner_writes(index_path):
    """A's cached blocks are evicted and one is handed to B; the core dies right after the
    ranks wrote B's prompt, before B's blocks were listed. The next core must not find A's
    prefix in that block."""
    s = new_core(index_path, chunked=False, swap=False, budget=64)
    pool = Pool(12, 4, 6)
    a = make_request("a", prompt=list(range(100, 109)), max_tokens=1)
    s.add_request(a)
    while s.has_work:
        out = s.schedule()
        pool.run(out)
        s.update(out, [3 for w in out.work if w.samples])
    listed = set(s.block_manager.index.entries())
    assert len(listed) == 2
    b = make_request("b", prompt=list(range(500, 544)), max_tokens=1)  # 11 of the 12 blocks
    s.add_request(b)
    out = s.schedule()
    assert len(listed & set(out.work[0].new_block_ids)) == 1  # one of A's is B's now
    pool.run(out)  # the ranks wrote B's KV; the core dies before the update
    s = new_core(index_path, chunked=False, swap=False, budget=64)
    again = make_request("a'", prompt=list(range(100, 109)), max_tokens=1)
    s.add_request(again)
    out = s.schedule()
    assert out.work[0].start == 4  # A's first block, still A's; not the second, now B's
    pool.run(out)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=OPS, chunked=st.booleans(), swap=st.booleans(), budget=st.integers(8, 40))
def test_no_request_reads_another_requests_kv_across_core_deaths(index_path, ops, chunked,
                                                                 swap, budget):
    """A tiny pool (so steps preempt and cached blocks are evicted and reused) and prompts from
    four shared prefixes; "die" ends the core, after its step reached the ranks or not, and a
    new one adopts the index and takes every live request back as prompt + its tokens so far,
    as the gateway resubmits them."""
    BlockIndex(index_path).claim(b"\0" * 16, 12)  # each example starts from an empty index
    s = new_core(index_path, chunked, swap, budget)
    pool = Pool(12, 4, 6)
    added = []
    for op in ops:
        if op[0] != "die":
            apply(s, added, op, pool.run)
            assert s.check() == [], op
            continue
        if op[1]:  # the ranks wrote the step's KV; the core died before its update
            pool.run(s.schedule())
        live = [r for r in added if r.request_id in s.requests]
        s = new_core(index_path, chunked, swap, budget)
        added = []  # the new core's, each taken back as prompt + its tokens so far
        for request in live:
            again = make_request(f"r{len(added)}'", prompt=request.token_slice(
                0, request.num_tokens), max_tokens=max(1, request.params.max_tokens
                                                         - request.num_output_tokens),
                                 ignore_eos=True)
            added.append(again)
            s.add_request(again)
        assert s.check() == [], op
    for _ in range(500):
        if not s.has_work:
            break
        out = s.schedule()
        pool.run(out)
        s.update(out, [9 for w in out.work if w.samples])
        assert s.check() == []
    assert not s.has_work


# --- the engine core's side (PoolAdoption) ---------------------------------------------------

class StandInExecutor:
    """What PoolAdoption reads of an Executor: its group's pool layout, the pool's paths, and
    its ranks' dtype and weights."""

    def __init__(self, index_path, layout):
        self.layout = layout
        self.group = self
        self.ready = self
        self.pool = PoolPaths((), index_path)
        self.dtype, self.weights = "float32", "dequantized"

    def pool_layout(self):
        return self.layout


def adoption(index_path, layout) -> tuple[PoolAdoption, StandInExecutor, list[str]]:
    """A PoolAdoption over a fresh block manager; the executor; the event kinds it logs."""
    events = []
    executor = StandInExecutor(index_path, layout)
    adopting = PoolAdoption(executor, BlockManager(16, 4), "dummy:tiny",
                            lambda kind, request_id, **fields: events.append(kind))
    return adopting, executor, events


def test_a_core_lets_go_of_the_index_when_its_new_ranks_read_another_pool(index_path):
    core, executor, events = adoption(index_path, [("rank 0", "float32")])
    assert core.adopt() == (0, None)
    served(core.block_manager, make_request("a", prompt=list(range(100, 113))))
    core.follow_restart()  # the same layout: the index stays
    assert core.block_manager.index is not None and len(core.block_manager.index.entries()) == 3
    executor.layout = None  # a restarted rank allocated a pool of its own
    core.follow_restart()
    assert core.block_manager.index is None and events[-1] == "pool_index_dropped"
    # What the index listed was emptied: the next core adopts nothing of it.
    assert adoption(index_path, [("rank 0", "float32")])[0].adopt() == (0, None)


def test_a_core_whose_ranks_have_pools_of_their_own_keeps_no_index(index_path):
    core = adoption(index_path, None)[0]
    blocks, refused = core.adopt()
    assert blocks == 0 and "their own" in refused and core.block_manager.index is None
