"""Replica-level recovery with real processes on dummy:tiny: a rank killed (SIGKILL) or hung
(SIGSTOP) mid-batch is detected, the whole group is replaced, and every stream continues at its
next index with exactly the tokens a fault-free run gives. On the host the new group maps the
old one's KV pool, so the failed step runs again and nothing is re-prefilled."""

import os
import shutil
import signal
import time

import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig
from tokstream.engine.llm import LLM
from tokstream.engine.messages.request import EngineRequest
from tokstream.errors import ErrorKind, OverloadedError
from tokstream.sampling_params import SamplingParams

pytestmark = pytest.mark.startup  # starts servers or engines (make test-fast leaves it out)

PROMPTS = [[5 + i, 17, 99, 3 + i] * (i + 2) for i in range(6)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)


def config(tp=2, **overrides):
    base = EngineConfig(model="dummy:tiny", dtype="float32", tp=tp,
                        cache=CacheConfig(block_size=4),
                        scheduler=SchedulerConfig(max_num_batched_tokens=24))
    for key, value in overrides.items():
        setattr(base, key, value)
    return base


def requests(tag):
    return [EngineRequest(f"{tag}{i}", p, GREEDY if i % 2 == 0 else SAMPLED)
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def clean_run():
    """(the tokens of a fault-free run, the prompt tokens it computed)."""
    with LLM(config(tp=1)) as llm:
        return collect(llm, requests("r"))[0], llm.core.prefill_tokens_total


@pytest.fixture(scope="module")
def reference(clean_run):
    return clean_run[0]


def assert_kv_kept(llm, clean_run):
    """Each new group mapped the old one's pool (CPU): nothing was computed twice."""
    kept = [e["kv"] for e in llm.core.events if e["kind"] == "restarted"]
    assert kept and set(kept) == {"kept"}, kept
    assert llm.core.prefill_tokens_total == clean_run[1]


def collect(llm, reqs, fault=None):
    """Run reqs to the end; fault(llm, tokens_so_far) may inject a fault between steps.
    Returns ({request: tokens}, per-request index lists)."""
    tokens = {r.request_id: [] for r in reqs}
    indices = {r.request_id: [] for r in reqs}
    finished = {}
    for delta in llm.stream(reqs):
        tokens[delta.request_id] += delta.token_ids
        indices[delta.request_id] += range(delta.first_index,
                                           delta.first_index + len(delta.token_ids))
        if delta.finished:
            assert delta.request_id not in finished, "a stream ended twice"
            finished[delta.request_id] = delta.finish_reason
        if fault is not None:
            fault(llm, tokens)
    assert all(reason == "length" for reason in finished.values()), finished
    assert len(finished) == len(reqs)
    for rid, seen in indices.items():
        assert seen == list(range(len(tokens[rid]))), f"{rid}: gap, duplicate or reorder"
    return [tokens[r.request_id] for r in reqs], indices


def once(condition, action):
    done = []

    def fault(llm, tokens):
        if not done and condition(llm, tokens):
            done.append(True)
            action(llm)
    fault.done = done
    return fault


def mid_decode(llm, tokens):
    return len(tokens["r0"]) >= 5


def mid_prefill(llm, tokens):
    # The budget of 24 tokens chunks the longer prompts: some are still prefilling.
    running = llm.core.scheduler.running
    return any(r.num_computed_tokens < len(r.prompt_token_ids) for r in running)


def kill_rank(rank, sig=signal.SIGKILL):
    def action(llm):
        os.kill(llm.core.executor.pids[rank], sig)
    return action


@pytest.mark.parametrize("rank,when", [(0, mid_decode), (1, mid_decode), (1, mid_prefill),
                                       (0, mid_prefill)])
def test_killed_rank_is_replaced_and_streams_continue(reference, clean_run, rank, when):
    with LLM(config()) as llm:
        old_pids = list(llm.core.executor.pids)
        fault = once(when, kill_rank(rank))
        out, _ = collect(llm, requests("r"), fault)
        assert fault.done, "the fault never fired"
        assert llm.core.recovery.restarts == 1 and llm.core.status == "ready"
        assert_kv_kept(llm, clean_run)
        assert not set(llm.core.executor.pids) & set(old_pids)
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    assert out == reference


def test_hung_rank_is_caught_by_the_step_deadline(reference, clean_run):
    with LLM(config(step_timeout_s=3.0)) as llm:
        stopped = []

        def stall(llm):
            pid = llm.core.executor.pids[1]
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        fault = once(mid_decode, stall)
        try:
            out, _ = collect(llm, requests("r"), fault)
        finally:
            for pid in stopped:  # reaped by the teardown (SIGKILL); never leave one stopped
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        assert llm.core.recovery.restarts == 1
        assert any(e["kind"] == "rank_failure" and "hung" in e["reason"]
                   for e in llm.core.events)
        assert_kv_kept(llm, clean_run)  # the stopped rank was killed before the pool was read
    assert out == reference


def test_two_faults_in_a_row_and_a_warm_spare(reference, clean_run):
    with LLM(config(spare=True)) as llm:
        spare_pids = list(llm.core.executor.spare.pids)
        faults = [once(lambda l, t: len(t["r1"]) >= 3, kill_rank(0)),
                  once(lambda l, t: len(t["r1"]) >= 9, kill_rank(1))]
        out, _ = collect(llm, requests("r"), lambda l, t: [f(l, t) for f in faults])
        assert all(f.done for f in faults)
        assert llm.core.recovery.restarts == 2
        # The first failure swapped the spare in rather than starting processes.
        assert llm.core.events and spare_pids[0] in [
            pid for e in llm.core.events if e["kind"] == "restarted" for pid in e["pids"]]
        assert_kv_kept(llm, clean_run)  # the spare maps the same pool files
    assert out == reference


def test_recovery_that_keeps_failing_goes_down_then_comes_back(tmp_path, reference):
    """A model folder that vanishes makes every restart fail: the replica goes down (streams
    end with an error, new requests are refused); once it is back, a retry succeeds."""
    import torch

    from tokstream.model.source import resolve_model
    from tokstream.model.weights import load_state_dict, save_hf_folder
    from tokstream.text.tokenizer import load_tokenizer

    source = resolve_model("dummy:tiny")
    folder = tmp_path / "tiny"
    save_hf_folder(folder, source.config, load_state_dict(source, torch.float32, seed=0),
                   load_tokenizer(source).to_json())
    with LLM(config(model=str(folder), max_recovery_attempts=2)) as llm:
        hidden = tmp_path / "hidden"

        def break_everything(llm):
            folder.rename(hidden)
            os.kill(llm.core.executor.pids[0], signal.SIGKILL)
        fault = once(mid_decode, break_everything)
        finishes = {}
        for delta in llm.stream(requests("r")):
            if delta.finished:
                finishes[delta.request_id] = (delta.finish_reason, delta.error, delta.error_kind)
            fault(llm, {"r0": [0] * (delta.first_index + 1)} if delta.request_id == "r0"
                  else {"r0": []})
        assert llm.core.status == "down"
        assert all(reason == "error" and "down" in error and kind == ErrorKind.REPLICA
                   for reason, error, kind in finishes.values())
        assert len(finishes) == len(PROMPTS)
        with pytest.raises(OverloadedError):
            llm.core.add_request(EngineRequest("late", PROMPTS[0], GREEDY))
        hidden.rename(folder)
        llm.core.recovery.next_retry = 0.0  # don't wait out the back-off in a test
        llm.core.step()
        assert llm.core.status == "ready"
        out, _ = collect(llm, requests("again"))
    assert out == reference


def test_without_a_shared_pool_every_request_is_recomputed(reference, clean_run, monkeypatch):
    # The path a GPU takes (its memory dies with the rank) and a host without memfd.
    from tokstream.engine.recovery.pool_files import PoolFiles
    monkeypatch.setattr(PoolFiles, "paths", lambda self: None)
    with LLM(config()) as llm:
        fault = once(mid_decode, kill_rank(1))
        out, _ = collect(llm, requests("r"), fault)
        assert fault.done
        assert [e["kv"] for e in llm.core.events if e["kind"] == "restarted"] == ["recomputed"]
        assert llm.core.prefill_tokens_total > clean_run[1]
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    assert out == reference
