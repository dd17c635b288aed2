"""Speculative decoding's bookkeeping, pure Python (issue 34): drafted positions get KV slots,
rejected ones are rolled back and their blocks given back, the workers' block tables follow,
and the output is the one plain decoding gives. Hand-fed step results, no model: a fake rank
samples from a deterministic next-token rule over exactly the tokens each row sees."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokstream.config import SpeculativeConfig
from tokstream.engine.request import RequestStatus
from tokstream.engine.speculation import Speculator, num_accepted
from test_scheduler import make_request, make_scheduler


def spec_scheduler(k=4, **config):
    s = make_scheduler(**config)
    s.speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k))
    return s


class WorkerTables:
    """The block tables a worker keeps, updated from each plan as model_runner does."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def apply(self, plan) -> None:
        for request_id in plan.finished_ids:
            self.tables.pop(request_id, None)
        for new in plan.new_requests:
            self.tables[new.request_id] = []
        for chunk in plan.chunks:
            table = self.tables[chunk.request_id]
            if chunk.kept_blocks is not None:
                del table[chunk.kept_blocks:]
            table.extend(chunk.new_block_ids)


def rows_of(plan, requests):
    """Per sampled row, the tokens it sees: the request's tokens before the chunk, then the
    chunk's up to the row's position (drafts included)."""
    rows = []
    for chunk in plan.chunks:
        if chunk.sample_index is None:
            continue
        before = requests[chunk.request_id].token_slice(0, chunk.start_position)
        last = len(chunk.token_ids) - 1 - chunk.num_draft_tokens
        for i in range(chunk.num_draft_tokens + 1):
            rows.append((chunk, before + chunk.token_ids[:last + i + 1]))
    return rows


def model(tokens: list[int]) -> int:
    """A greedy "model" that copies a lot (so drafts are often right) but not always, and
    whose every token depends on the one before it (so a row after a wrong draft is wrong)."""
    if len(tokens) < 4:
        return 50
    if (tokens[-1] + len(tokens)) % 5 == 0:
        return 100 + (7 * tokens[-1] + tokens[-2]) % 9
    return tokens[-4]


def run(s, requests, tables=None, sample=None, max_steps=2000):
    """Step until every request finishes, checking the bookkeeping after each step."""
    for request in requests:
        s.add_request(request)
    live = {r.request_id: r for r in requests}
    step_id = 0
    while s.has_work:
        step_id += 1
        assert step_id < max_steps
        out = s.schedule()
        plan = out.plan(step_id)
        if tables is not None:
            tables.apply(plan)
            for work in out.work:
                assert tables.tables[work.request.request_id] == work.request.block_ids
        rows = rows_of(plan, live)
        sampled = sample(rows) if sample is not None else [model(seen) for _, seen in rows]
        s.update(out, sampled)
        assert s.check() == []
        for work in out.work:
            request = work.request
            if request.status == RequestStatus.RUNNING and work.samples:
                # A decoding request holds the K/V of all but its newest token, and only the
                # blocks those fill.
                assert request.num_computed_tokens == request.num_tokens - 1
                assert len(request.block_ids) == s.block_manager.blocks_for(
                    request.num_computed_tokens)
    return step_id


def copy_requests(n=4, max_tokens=40, prefix="r"):
    return [make_request(f"{prefix}{i}", prompt=[10 + i, 20, 30, 40 + i] * (2 + i),
                         max_tokens=max_tokens, ignore_eos=True) for i in range(n)]


def outputs(requests):
    return [list(r.output_token_ids) for r in requests]


def test_greedy_output_equals_plain_decoding_and_drafts_are_accepted():
    plain = copy_requests()
    run(make_scheduler(num_blocks=128, budget=64), plain)
    s = spec_scheduler(num_blocks=128, budget=64)
    spec = copy_requests()
    tables = WorkerTables()
    spec_steps = run(s, spec, tables)
    assert outputs(spec) == outputs(plain)
    stats = s.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert s.block_manager.num_free_blocks == 128
    assert spec_steps < 40  # fewer steps than the 40 tokens each: drafts saved steps
    assert s.speculator.drafters == {}  # forgotten with their requests


def test_a_tiny_pool_preempts_and_the_output_is_unchanged():
    plain = copy_requests(max_tokens=30)
    run(make_scheduler(num_blocks=128, budget=32), plain)
    s = spec_scheduler(num_blocks=18, budget=32)
    spec = copy_requests(max_tokens=30)
    run(s, spec, WorkerTables())
    assert s.num_preemptions > 0
    assert outputs(spec) == outputs(plain)
    assert s.block_manager.num_free_blocks == 18


def test_stop_tokens_and_max_tokens_cut_accepted_drafts():
    """A stop token among the accepted tokens ends the output there, as plain decoding would
    have (the rule emits 100..106 every fifth position; 103 stops)."""
    plain = copy_requests(max_tokens=37, prefix="s")
    for r in plain:
        r.params.stop_token_ids = [103]
    run(make_scheduler(num_blocks=128), plain)
    spec = copy_requests(max_tokens=37, prefix="s")
    for r in spec:
        r.params.stop_token_ids = [103]
    s = spec_scheduler(num_blocks=128)
    run(s, spec, WorkerTables())
    assert outputs(spec) == outputs(plain)
    assert any(r.stop_reason == 103 for r in spec) and any(
        r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 37 for r in spec)


def test_constrained_penalised_and_logprobs_requests_draft():
    """A grammar's matcher follows each draft on the rank (worker/grammar.py), penalties and
    logprobs see each row's output: every kind of request drafts."""
    s = spec_scheduler(num_blocks=128)
    kinds = [dict(grammar='start: "a"+'), dict(frequency_penalty=0.5),
             dict(repetition_penalty=1.2), dict(logprobs=2)]
    for i, kind in enumerate(kinds):
        before = s.speculator.stats.num_drafts
        run(s, [make_request(f"k{i}", prompt=[1, 2, 3, 4] * 4, max_tokens=12,
                             ignore_eos=True, **kind)], WorkerTables())
        assert s.speculator.stats.num_drafts > before, kind


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), k=st.integers(1, 6), num_blocks=st.integers(14, 80),
       block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(8, 64))
def test_any_accept_counts_leak_no_block(seed, k, num_blocks, block_size, budget):
    """A fake rank accepts a random number of each request's drafts (the first row that
    disagrees gets another token): the request gains exactly the accepted drafts and that
    token, the pool ends whole, and every step's bookkeeping checks clean."""
    import random

    rng = random.Random(seed)
    s = spec_scheduler(k=k, num_blocks=num_blocks, block_size=block_size, budget=budget)
    requests = [make_request(f"h{i}", prompt=[7, 8, 9] * rng.randint(1, 6) + [i],
                             max_tokens=rng.randint(1, 30), ignore_eos=True)
                for i in range(rng.randint(1, 5))]
    expected_gain = {}

    def sample(rows):
        out, by_chunk = [], {}
        for chunk, _ in rows:
            by_chunk.setdefault(id(chunk), (chunk, []))[1].append(None)
        for chunk, cells in by_chunk.values():
            drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens:]
            accept = rng.randint(0, len(drafts))
            tokens = drafts[:accept] + [rng.choice([7, 8, 9, 1000 + accept])]
            if accept < len(drafts) and tokens[-1] == drafts[accept]:
                tokens[-1] = 999  # disagree at the first rejected row
            tokens += [rng.randint(0, 5) for _ in range(len(cells) - len(tokens))]
            expected_gain[chunk.request_id] = tokens[:accept + 1]
            out += tokens
        return out

    before = {}
    original_update = s.update

    def update(out, sampled):
        for work in out.work:
            before[work.request.request_id] = list(work.request.output_token_ids)
        advanced = original_update(out, sampled)
        for work in out.work:
            request = work.request
            if work.is_verify and request.status == RequestStatus.RUNNING:
                gained = request.output_token_ids[len(before[request.request_id]):]
                assert gained == expected_gain[request.request_id]
        return advanced

    s.update = update
    run(s, requests, WorkerTables(), sample=sample)
    assert s.block_manager.num_free_blocks == num_blocks
    assert all(r.status.is_finished for r in requests)
    stats = s.speculator.stats
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens <= stats.num_draft_tokens


def test_drafts_are_accepted_up_to_the_first_disagreement():
    assert num_accepted([1, 2, 3], [1, 2, 9, 4]) == 2
    assert num_accepted([1, 2], [1, 2, 3]) == 2  # all, and the bonus token after them
    assert num_accepted([1, 2], [2, 2, 3]) == 0  # a later agreement counts for nothing
    assert num_accepted([], [5]) == 0
