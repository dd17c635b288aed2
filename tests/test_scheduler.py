"""Scheduler and block manager, pure Python: hand-built requests, hand-fed step results."""

import itertools

import pytest

from tokstream.config import SchedulerConfig
from tokstream.engine.block_manager import BlockManager, SwapSpace
from tokstream.engine.request import Request, RequestStatus
from tokstream.engine.scheduler.scheduler import Scheduler
from tokstream.errors import UserInputError
from tokstream.sampling_params import SamplingParams

_clock = itertools.count()


def make_request(rid, prompt_len=10, max_tokens=8, prompt=None, salt="", **params):
    # Distinct prompts unless one is given, so prefix caching only acts where a test wants it.
    first = 1000 * (1 + sum(map(ord, rid)) % 50)
    return Request(rid, prompt or list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, temperature=0, **params),
                   seed=0, arrival=float(next(_clock)), cache_salt=salt)


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=8, watermark=0,
                   caching=True, swap_blocks=None, **config):
    bm = BlockManager(num_blocks, block_size, enable_caching=caching)
    # Long prefills share the decodes' steps here, held to the ITL target, unless a test asks
    # for the defaults' prefill steps of their own (test_scheduler_prefill_alone.py).
    config = {"long_prefill_alone": False, "long_prefill_step_ms": 0.0, **config}
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             watermark_blocks=watermark, **config)
    swap = SwapSpace(swap_blocks) if swap_blocks is not None else None
    scheduler = Scheduler(config, bm, max_model_len=1000, eos_token_ids=(2,), swap_space=swap)
    scheduler.clock = lambda: float(next(_clock))  # the requests' arrival clock
    return scheduler


def run_step(s, token=7):
    out = s.schedule()
    sampled = [token for w in out.work if w.samples]
    s.update(out, sampled)
    assert s.check() == []
    return out


def test_prefill_then_decode_and_free():
    s = make_scheduler()
    r = make_request("a", prompt_len=10, max_tokens=3)
    s.add_request(r)
    out = run_step(s)
    assert [(w.start, w.num_tokens, w.is_new) for w in out.work] == [(0, 10, True)]
    assert len(r.block_ids) == 3 and r.output_token_ids == [7]
    out = run_step(s)
    assert [(w.start, w.num_tokens) for w in out.work] == [(10, 1)]
    run_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert s.block_manager.num_free_blocks == 64
    assert not s.has_work
    assert s.schedule().forgotten_ids == ["a"]


def test_decodes_come_first_and_budget_chunks_prefill():
    s = make_scheduler(budget=8)
    a = make_request("a", prompt_len=4, max_tokens=50)
    s.add_request(a)
    run_step(s)
    b = make_request("b", prompt_len=20)
    s.add_request(b)
    out = run_step(s)
    assert [(w.request.request_id, w.start, w.num_tokens) for w in out.work] == [
        ("a", 4, 1), ("b", 0, 7)]
    assert not out.work[1].samples and b.output_token_ids == []
    out = run_step(s)
    assert [(w.request.request_id, w.start, w.num_tokens) for w in out.work] == [
        ("a", 5, 1), ("b", 7, 7)]
    out = run_step(s)
    assert [(w.request.request_id, w.start, w.num_tokens) for w in out.work] == [
        ("a", 6, 1), ("b", 14, 6)]
    assert out.work[1].samples and b.output_token_ids == [7]


def test_max_num_seqs_caps_admission():
    s = make_scheduler(max_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid))
    out = run_step(s)
    assert [w.request.request_id for w in out.work] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_eos_and_stop_token_finish():
    s = make_scheduler()
    a = make_request("a", stop_token_ids=[9])
    b = make_request("b")
    c = make_request("c", ignore_eos=True)
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    s.update(out, [9, 2, 2])
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 9
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason is None
    assert c.status == RequestStatus.RUNNING


def test_no_end_before_min_tokens():
    """The sampler bans ending tokens before min_tokens; the scheduler, which decides, does
    not end a request on one either (token 3 of min_tokens 3 is the last that cannot)."""
    s = make_scheduler()
    a = make_request("a", stop_token_ids=[9], min_tokens=3)
    b = make_request("b", min_tokens=3)
    for r in (a, b):
        s.add_request(r)
    for token in (9, 9, 9):
        s.update(s.schedule(), [token, 2])
        assert a.status == b.status == RequestStatus.RUNNING
    s.update(s.schedule(), [9, 2])
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 9
    assert b.status == RequestStatus.FINISHED_STOPPED and b.num_output_tokens == 4


def test_preemption_picks_latest_arrival_and_recomputes():
    # 6 blocks of 4 tokens; two requests of 8-token prompts take 2 blocks each, then grow.
    s = make_scheduler(num_blocks=6, block_size=4)
    a = make_request("a", prompt_len=8, max_tokens=14)
    b = make_request("b", prompt_len=8, max_tokens=14)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    for _ in range(40):
        if not s.has_work:
            break
        out = run_step(s)
        preempted += [r.request_id for r in out.preempted]
        used = sum(len(r.block_ids) for r in s.running)
        assert used == s.block_manager.num_used_blocks <= 6
        for w in out.work:  # a preempted request is never also scheduled in the same step
            assert w.request.status != RequestStatus.PREEMPTED
    assert preempted and set(preempted) == {"b"}
    assert a.output_token_ids == [7] * 14 and b.output_token_ids == [7] * 14
    assert b.num_preemptions >= 1
    assert s.block_manager.num_free_blocks == 6


def test_readmitted_request_recomputes_prompt_and_outputs():
    s = make_scheduler(num_blocks=5, block_size=4)
    a = make_request("a", prompt_len=8, max_tokens=12)
    b = make_request("b", prompt_len=8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    seen = None
    for _ in range(60):
        if not s.has_work:
            break
        out = s.schedule()
        for w in out.work:
            if w.request is b and w.is_new and b.output_token_ids:
                seen = (w.start, w.num_tokens, b.num_tokens)
        s.update(out, [7 for w in out.work if w.samples])
    assert seen is not None
    start, num, total = seen
    # The re-admission recomputes everything it had: prompt + output so far.
    assert start == 0 and num == total


def test_request_too_big_for_pool_finishes_instead_of_hanging():
    s = make_scheduler(num_blocks=3, block_size=4)
    big = make_request("big", prompt_len=20)
    s.add_request(big)
    out = s.schedule()
    assert out.finished == [big] and big.status == RequestStatus.FINISHED_LENGTH
    grows = make_request("grows", prompt_len=8, max_tokens=100)
    s.add_request(grows)
    for _ in range(20):
        if not s.has_work:
            break
        run_step(s)
    assert grows.status == RequestStatus.FINISHED_LENGTH
    assert grows.stop_reason == "kv_cache_capacity" and grows.num_output_tokens == 5
    assert s.block_manager.num_free_blocks == 3


def test_finish_while_waiting_and_abort_frees_blocks():
    s = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_request("a"), make_request("b")
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == 8 - len(b.block_ids)
    assert s.schedule().forgotten_ids == ["a"]
    c = make_request("c")
    s.add_request(c)
    s.finish(c, RequestStatus.FINISHED_ABORTED)
    assert c not in s.waiting


def test_block_manager_refcounts():
    bm = BlockManager(4, 4)
    r = make_request("r", prompt_len=5)
    assert bm.allocate(r, 5) == [0, 1]
    assert bm.num_new_blocks(r, 5) == 0  # num_computed is still 0: 5 tokens fit in 2 blocks
    assert bm.allocate(r, 20) is None and r.block_ids == [0, 1]
    bm.free(r)
    assert bm.num_free_blocks == 4 and bm.ref_counts == [0] * 4


@pytest.mark.parametrize("watermark", [0, 3])
def test_watermark_holds_blocks_back_from_admission(watermark):
    s = make_scheduler(num_blocks=6, block_size=4, watermark=watermark)
    s.add_request(make_request("a", prompt_len=8))
    s.add_request(make_request("b", prompt_len=8))
    out = s.schedule()
    assert len(out.work) == (2 if watermark == 0 else 1)


def test_prefix_cache_shares_full_blocks_read_only():
    s = make_scheduler(block_size=4)
    prompt = list(range(500, 514))  # 14 tokens: 3 full blocks + 2
    a = make_request("a", prompt=prompt, max_tokens=4)
    s.add_request(a)
    run_step(s)
    assert s.block_manager.num_cached_blocks == 3
    b = make_request("b", prompt=prompt + [7, 7], max_tokens=4)
    s.add_request(b)
    out = run_step(s)
    work_b = [w for w in out.work if w.request is b][0]
    # b reuses a's three full blocks and computes only the rest; the worker learns them all.
    assert (work_b.start, work_b.num_tokens) == (12, 4)
    assert b.block_ids[:3] == a.block_ids[:3] and work_b.new_block_ids == b.block_ids
    assert [s.block_manager.ref_counts[i] for i in a.block_ids[:3]] == [2, 2, 2]
    # New tokens never land in a shared block: b's 4th block is its own.
    assert b.block_ids[3] not in a.block_ids
    assert s.block_manager.prefix_hits == 12


def test_whole_prompt_cached_still_computes_its_last_token():
    s = make_scheduler(block_size=4)
    prompt = list(range(600, 608))  # exactly 2 blocks
    a = make_request("a", prompt=prompt, max_tokens=1)
    s.add_request(a)
    run_step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH
    b = make_request("b", prompt=prompt, max_tokens=1)
    s.add_request(b)
    out = run_step(s)
    assert [(w.start, w.num_tokens) for w in out.work] == [(4, 4)]
    assert b.output_token_ids == [7]


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    s = make_scheduler(num_blocks=4, block_size=4)
    a = make_request("a", prompt=list(range(700, 708)), max_tokens=1)
    s.add_request(a)
    run_step(s)
    bm = s.block_manager
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    # A 12-token newcomer needs 3 blocks: the two never-used ones, then one of a's cached
    # blocks, the tail first (freed in reverse, so the shareable head survives longest).
    c = make_request("c", prompt=list(range(800, 812)), max_tokens=1)
    s.add_request(c)
    run_step(s)
    assert bm.num_cached_blocks == 4  # c's three, plus a's head
    again = make_request("a2", prompt=list(range(700, 708)) + [5], max_tokens=1)
    s.add_request(again)
    run_step(s)
    assert bm.prefix_hits == 4  # a's first block was still there; its second was not


def test_salts_keep_tenants_apart_and_caching_can_be_off():
    for caching, salt_b, expected in ((True, "", 4), (True, "tenant-b", 0), (False, "", 0)):
        s = make_scheduler(block_size=4, caching=caching)
        prompt = list(range(900, 910))
        s.add_request(make_request("a", prompt=prompt, max_tokens=2))
        run_step(s)
        s.add_request(make_request("b", prompt=prompt, max_tokens=2, salt=salt_b))
        run_step(s)
        assert s.block_manager.prefix_hits == expected * 2, (caching, salt_b)


def test_preempted_request_reuses_its_own_cached_blocks():
    s = make_scheduler(num_blocks=6, block_size=4)
    a = make_request("a", prompt_len=8, max_tokens=14)
    b = make_request("b", prompt_len=8, max_tokens=14)
    s.add_request(a)
    s.add_request(b)
    for _ in range(60):
        if not s.has_work:
            break
        run_step(s)
    assert b.num_preemptions >= 1 and s.block_manager.prefix_hits > 0
    assert a.output_token_ids == [7] * 14 and b.output_token_ids == [7] * 14


def tenant_request(rid, tenant, prompt_len=8, max_tokens=4, priority=0, weight=1.0):
    r = make_request(rid, prompt_len=prompt_len, max_tokens=max_tokens)
    r.tenant, r.priority, r.weight = tenant, priority, weight
    return r


def admitted_order(s, steps=200):
    order = []
    for _ in range(steps):
        if not s.has_work:
            break
        out = run_step(s)
        order += [w.request.request_id for w in out.work if w.is_new]
    return order


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_hot_tenant_does_not_starve_the_others(policy):
    s = make_scheduler(num_blocks=256, max_seqs=2)
    s.config.policy = policy
    s.waiting.policy = policy
    for i in range(10):
        s.add_request(tenant_request(f"hot{i}", "hot"))
    s.add_request(tenant_request("cold0", "cold"))
    s.add_request(tenant_request("cold1", "cold"))
    order = admitted_order(s)
    position = order.index("cold0")
    if policy == "fair":
        assert position <= 2  # as soon as the hot tenant has been served more
        assert order.index("cold1") <= 4
    else:
        assert position == 10  # strictly behind the hot tenant's backlog


def test_weights_share_admissions():
    s = make_scheduler(num_blocks=512, max_seqs=1)
    for i in range(12):
        s.add_request(tenant_request(f"a{i}", "a", weight=2.0))
        s.add_request(tenant_request(f"b{i}", "b", weight=1.0))
    first_twelve = admitted_order(s)[:12]
    count_a = sum(1 for rid in first_twelve if rid.startswith("a"))
    assert count_a == 8  # twice the weight, twice the share


def test_a_tenant_back_from_idle_earns_no_credit():
    s = make_scheduler(num_blocks=512, max_seqs=1)
    for i in range(4):
        s.add_request(tenant_request(f"busy{i}", "busy"))
    admitted_order(s)
    served = s.ledger.counter("busy")
    assert served > 0 and s.ledger.counter("idle") == 0
    # Both come back; the idle one is lifted to the busy one's counter, not left far below.
    s.add_request(tenant_request("busy-again", "busy"))
    s.add_request(tenant_request("idle0", "idle"))
    assert s.ledger.counter("idle") == pytest.approx(served)
    for i in range(1, 4):
        s.add_request(tenant_request(f"idle{i}", "idle"))
    order = admitted_order(s)
    assert order.index("busy-again") <= 2  # not stuck behind every idle request


def test_priority_tiers_come_first_and_are_preempted_last():
    s = make_scheduler(num_blocks=512, max_seqs=1)
    s.add_request(tenant_request("batch", "t", priority=1))
    s.add_request(tenant_request("chat", "t", priority=0))
    assert admitted_order(s)[:2] == ["chat", "batch"]
    s = make_scheduler(num_blocks=6, block_size=4)
    low = tenant_request("low", "t", prompt_len=8, max_tokens=14, priority=1)
    high = tenant_request("high", "u", prompt_len=8, max_tokens=14, priority=0)
    s.add_request(low)  # arrives first, but is the lower tier
    s.add_request(high)
    preempted = []
    for _ in range(80):
        if not s.has_work:
            break
        preempted += [r.request_id for r in run_step(s).preempted]
    assert preempted and set(preempted) == {"low"}
    assert high.output_token_ids == [7] * 14 and low.output_token_ids == [7] * 14


def test_long_requests_are_capped_per_tenant():
    s = make_scheduler(num_blocks=512, budget=512, max_seqs=8)
    s.config.long_request_tokens = 32
    s.config.max_long_requests_per_tenant = 1
    s.add_request(tenant_request("long0", "agent", prompt_len=40, max_tokens=6))
    s.add_request(tenant_request("long1", "agent", prompt_len=40, max_tokens=6))
    s.add_request(tenant_request("short", "agent", prompt_len=8, max_tokens=6))
    s.add_request(tenant_request("other-long", "other", prompt_len=40, max_tokens=6))
    out = run_step(s)
    started = {w.request.request_id for w in out.work}
    assert started == {"long0", "short", "other-long"}
    assert "long1" not in started
    order = admitted_order(s)
    assert "long1" in order


def chunks(out):
    return [(w.request.request_id, w.start, w.num_tokens) for w in out.work]


def test_chunking_off_prefills_a_prompt_whole_past_the_budget():
    s = make_scheduler(num_blocks=128, budget=8, chunked_prefill=False)
    a = make_request("a", prompt_len=4, max_tokens=50)
    s.add_request(a)
    run_step(s)
    b = make_request("b", prompt_len=30)
    c = make_request("c", prompt_len=6)
    s.add_request(b)
    s.add_request(c)
    # The decode goes first; b is taken whole (30 tokens against a budget of 8); c, which
    # would fit the budget on its own, waits: one over-budget prompt closes the step.
    assert chunks(run_step(s)) == [("a", 4, 1), ("b", 0, 30)]
    assert b.output_token_ids == [7]
    assert chunks(run_step(s)) == [("a", 5, 1), ("b", 30, 1), ("c", 0, 6)]


def test_chunk_size_caps_each_prompt_per_step():
    s = make_scheduler(budget=64, max_prefill_chunk=8)
    a, b = make_request("a", prompt_len=20), make_request("b", prompt_len=12)
    s.add_request(a)
    s.add_request(b)
    assert chunks(run_step(s)) == [("a", 0, 8), ("b", 0, 8)]
    assert chunks(run_step(s)) == [("a", 8, 8), ("b", 8, 4)]  # b's last chunk samples
    assert chunks(run_step(s)) == [("b", 12, 1), ("a", 16, 4)]  # decodes come first


@pytest.mark.parametrize("bad", [
    dict(max_prefill_chunk=-1), dict(chunked_prefill=False, max_prefill_chunk=16)])
def test_bad_chunk_settings_are_refused(bad):
    with pytest.raises(UserInputError, match="max_prefill_chunk"):
        SchedulerConfig(**bad)
