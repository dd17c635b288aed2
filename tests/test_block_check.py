"""The block manager's self-check (Scheduler.check / BlockManager.check), pure Python: the bug
it was written for (a waiting request left holding cached prefix blocks across a rank-group
restart), each of its rules proven by breaking the bookkeeping by hand, and a property test
over random add / abort / step / preempt / swap / recover sequences."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokstream.engine.request import RequestStatus
from test_scheduler import make_request, make_scheduler


def step(s, token=7):
    out = s.schedule()
    s.update(out, [token for w in out.work if w.samples])
    assert s.check() == []
    return out


def cached_prompt_then_long_and_sharing(s):
    """P runs to the end (its blocks stay cached), then B (about the whole budget) and
    C = P + a suffix arrive together: B takes the budget, C finds P's blocks and waits."""
    prefix = list(range(500, 532))  # 8 blocks of 4
    p = make_request("p", prompt=prefix + [1], max_tokens=1)
    s.add_request(p)
    step(s)
    assert p.status.is_finished and s.block_manager.num_cached_blocks == 8
    b = make_request("b", prompt_len=60, max_tokens=4)
    c = make_request("c", prompt=prefix + [900, 901, 902], max_tokens=4)
    s.add_request(b)
    s.add_request(c)
    return b, c


def test_a_whole_prompt_past_the_budget_gives_its_cached_prefix_back():
    s = make_scheduler(num_blocks=64, budget=62, chunked_prefill=False)
    b, c = cached_prompt_then_long_and_sharing(s)
    out = step(s)  # before the fix: "c is waiting but holds 8 pool blocks"
    assert [w.request.request_id for w in out.work] == ["b"]
    assert c.status == RequestStatus.WAITING and c.block_ids == []
    s.requeue_all()  # a rank died during b's step
    assert s.check() == [] and min(s.block_manager.ref_counts) == 0
    while s.has_work:
        step(s)
    # c recomputed its whole prompt: no block of the old pool was counted as computed.
    assert s.block_manager.num_free_blocks == 64


def test_recovery_forgets_what_waiting_requests_hold():
    """Even a waiting request that does hold blocks (whatever the path) is freed by a
    rank-group restart, so no reference count goes negative and no stale block is read."""
    s = make_scheduler(num_blocks=32)
    a = make_request("a", prompt_len=12, max_tokens=4)
    s.add_request(a)
    s.block_manager.match_prefix(a)
    s.block_manager.allocate(a, 12)
    assert s.check() != []  # a waiting holder is itself a finding
    s.requeue_all()
    assert s.check() == [] and a.block_ids == [] and a.num_computed_tokens == 0


def broken(mutate) -> list[str]:
    s = make_scheduler(num_blocks=16, swap_blocks=8)
    a = make_request("a", prompt=list(range(100, 108)) + [5], max_tokens=6)
    b = make_request("b", prompt=list(range(100, 108)) + [6], max_tokens=6)
    s.add_request(a)
    step(s)
    s.add_request(b)
    step(s)
    assert s.check() == []
    mutate(s, a, b)
    return s.check()


def test_each_rule_of_the_check_catches_its_break():
    bm = lambda s: s.block_manager  # noqa: E731
    cases = {
        "reference count": lambda s, a, b: bm(s).ref_counts.__setitem__(a.block_ids[-1], 2),
        "in 2 of free": lambda s, a, b: bm(s)._free.append(a.block_ids[-1]),
        "free list twice": lambda s, a, b: bm(s)._free.append(bm(s)._free[0]),
        "cached under another": lambda s, a, b: a.block_hashes.__setitem__(0, b"x" * 16),
        "not that of its tokens": lambda s, a, b: a.prompt_token_ids.__setitem__(0, 1),
        "maps disagree": lambda s, a, b: bm(s)._block_of.clear(),
        "cached mark": lambda s, a, b: bm(s)._cached_marks.__setitem__(15, 1),
        "holds 3 pool blocks": lambda s, a, b: setattr(a, "status", RequestStatus.WAITING),
        "host blocks": lambda s, a, b: s.swap_space._free.pop(),
        "no such block": lambda s, a, b: a.block_ids.append(99),
    }
    for expected, mutate in cases.items():
        problems = broken(mutate)
        assert any(expected in p for p in problems), (expected, problems)


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 20), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("recover")),
), min_size=1, max_size=60)


def apply(s, added: list, op: tuple, on_step=None) -> None:
    """One operation of OPS on scheduler s; added: every request it added so far. on_step:
    called with each step's output before its update (what the ranks would run)."""
    match op:
        case ("add", prefix, tail, max_tokens):
            # Prompts from four shared 8-token prefixes, so blocks are shared and cached.
            prompt = list(range(100 * prefix, 100 * prefix + 8)) + [7] * tail
            request = make_request(f"r{len(added)}", prompt=prompt, max_tokens=max_tokens,
                                   ignore_eos=True)
            added.append(request)
            s.add_request(request)
        case ("abort", index):
            if index < len(added):
                s.finish(added[index], RequestStatus.FINISHED_ABORTED)
        case ("step", token):
            out = s.schedule()
            if on_step is not None:
                on_step(out)
            s.update(out, [3 + token for w in out.work if w.samples])
        case ("recover",):
            s.requeue_all()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, chunked=st.booleans(), swap=st.booleans(), budget=st.integers(8, 40))
def test_bookkeeping_holds_under_random_sequences(ops, chunked, swap, budget):
    """A tiny pool (so steps preempt, by recompute or swap) and prompts drawn from four
    shared prefixes (so blocks are shared and cached); after every operation the check is
    clean, and at the end every block is free again."""
    s = make_scheduler(num_blocks=12, budget=budget, chunked_prefill=chunked,
                       swap_blocks=6 if swap else None)
    added = []
    for op in ops:
        apply(s, added, op)
        assert s.check() == [], op
    for _ in range(500):
        if not s.has_work:
            break
        step(s)
    assert not s.has_work
    assert s.check() == [] and s.block_manager.num_free_blocks == 12
