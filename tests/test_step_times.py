"""TOKSTREAM_STEP_TIMES: the engine core writes one line a step, whose counts add up to the
work it was given and whose times nest (rank 0's own time inside the round trip to the ranks);
bench/served_step.py's summary of such lines."""

import sys
from pathlib import Path

import pytest

from tokstream.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokstream.engine.llm import LLM
from tokstream.engine.step_times import StepTimes, read
from tokstream.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

PROMPTS = [[5 + i, 17, 99, 3 + i] * (i + 2) for i in range(3)]  # 8, 12 and 16 tokens
MAX_TOKENS = 5


@pytest.mark.startup
def test_each_step_is_written_and_its_counts_add_up(monkeypatch, tmp_path):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TOKSTREAM_STEP_TIMES", str(path))
    config = EngineConfig(model="dummy:tiny", dtype="float32", cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8),
                          speculative=SpeculativeConfig(method="off"))
    with LLM(config) as llm:
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [MAX_TOKENS] * len(PROMPTS)
    steps = read(str(path))
    assert [s.step_id for s in steps] == list(range(1, len(steps) + 1))
    # Prefill chunks of at most 8 tokens a step, then one decode a request a step.
    assert sum(s.tokens - s.decodes for s in steps) == sum(map(len, PROMPTS))
    assert sum(s.decodes for s in steps) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert not any(s.drafts for s in steps)
    assert all(s.tokens <= 8 or s.tokens == s.decodes for s in steps)
    assert all(0 < s.rank0_s <= s.ranks_s for s in steps)
    assert all(s.schedule_s >= 0 and s.emit_s >= 0 for s in steps)
    ends = [s.start + s.schedule_s + s.ranks_s + s.emit_s for s in steps]
    assert all(end <= after.start for end, after in zip(ends, steps[1:]))


def test_no_file_unless_asked(monkeypatch):
    from tokstream.engine.step_times import StepTimesLog

    monkeypatch.delenv("TOKSTREAM_STEP_TIMES", raising=False)
    assert StepTimesLog.from_env() is None


def test_a_line_cut_short_is_skipped(tmp_path):
    whole = '{"step_id": 1, "tokens": 2, "rows": 2, "decodes": 2, "drafts": 0, "start": 1.0, ' \
            '"schedule_s": 0.001, "ranks_s": 0.01, "rank0_s": 0.009, "emit_s": 0.001}'
    (tmp_path / "steps.jsonl").write_text(whole + "\n" + whole[:40])
    assert read(str(tmp_path / "steps.jsonl")) == [StepTimes(1, 2, 2, 2, 0, 1.0, 0.001, 0.01,
                                                             0.009, 0.001)]


def test_served_step_summary_splits_full_batch_decode_steps():
    from served_step import summarise

    def step(i, tokens, rows, decodes, start, drafts=0):
        return StepTimes(i, tokens, rows, decodes, drafts, start, 0.001, 0.040, 0.038, 0.002)

    steps = [step(1, 256, 2, 0, 0.0),  # a prefill step: 2 prompts of 128
             step(2, 2, 2, 2, 0.050),  # decode steps at the full batch of 2
             step(3, 3, 2, 2, 0.100, drafts=1),  # one draft verified
             step(4, 1, 1, 1, 0.150)]  # one stream left
    out = summarise(steps, concurrency=2)
    assert out["full_batch_decode_steps"] == 2 and out["drafts_verified"] == 1
    assert out["prefill_steps"] == {"count": 1, "tokens": 256, "seconds": 0.04,
                                    "sizes": [256]}
    decode = out["full_batch_decode"]
    # Each step ends 43 ms after it starts, and the next starts 50 ms after: a 7 ms gap.
    assert decode["gap_before"]["median_ms"] == pytest.approx(7.0)
    assert decode["round_trip_less_rank0"]["median_ms"] == pytest.approx(2.0)
    assert decode["whole"]["median_ms"] == pytest.approx(50.0)
