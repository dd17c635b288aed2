"""Workload mixes, the seeded request plan, clamping and the arrival schedule (no server)."""

import random
import statistics

import pytest

from tokstream.errors import UserInputError
from tokstream.loadgen.mix import MIX_DIR, available_mixes, load_mix, parse_mix
from tokstream.loadgen.plan import Limits, main_request
from tokstream.loadgen.prompts import HEADER, PromptBook
from tokstream.loadgen.schedule import Schedule
from tokstream.settings import load_profile

MIXES = ["agent-never-stops", "chat", "hot-tenant", "long-prompt-flood", "mixed", "shared-prefix"]


def limits_for(mix, context=65536, base=20):
    return Limits(context, {c.name: base for c in mix.classes})


def test_every_mix_loads_and_serving_profiles_are_untouched():
    assert available_mixes() == MIXES
    for name in MIXES:
        assert load_mix(name).classes
    assert load_mix(str(MIX_DIR / "chat.toml")).name == "chat"
    for name in ("ci", "cpu-smollm2", "gpu-llama-8b"):
        assert load_profile(name)["engine"]
    with pytest.raises(UserInputError, match="not found.*chat"):
        load_mix("no-such-mix")
    with pytest.raises(UserInputError, match="kind = \"mix\""):
        load_mix(str(MIX_DIR.parent / "ci.toml"))


@pytest.mark.parametrize("change,message", [
    ({"kind": "serve"}, 'kind = "mix"'),
    ({"class": []}, "at least one"),
    ({"class": [{"name": "a", "prompt_tokens": [10, 5]}]}, "class.0.prompt_tokens"),
    ({"class": [{"name": "a", "prompt_tokens": "lots"}]}, "class.0.prompt_tokens"),
    ({"class": [{"name": "a", "weight": -1}]}, "class.0.weight"),
    ({"class": [{"name": "a", "weight": 0}]}, "never send"),
    ({"class": [{"name": "a", "prompt_distribution": "zipf"}]}, "prompt_distribution"),
    ({"class": [{"name": "a", "speed": 3}]}, "unknown key"),
    ({"class": [{"name": "a", "prompt_tokens": 100, "shared_prefix_tokens": 100}]},
     "shared_prefix_tokens"),
    ({"tenants": {"a": 0}}, "positive share"),
    ({"run": {"arrival": "sometimes"}}, "run.arrival"),
    ({"surprise": 1}, "unknown key"),
])
def test_bad_mix_names_the_field(change, message):
    data = {"kind": "mix", "class": [{"name": "a"}], **change}
    with pytest.raises(UserInputError, match=message):
        parse_mix(data, "test")


def test_plan_is_a_pure_function_of_the_seed():
    mix = load_mix("hot-tenant")
    limits = limits_for(mix)
    first = [main_request(mix, limits, 7, n).row() for n in range(50)]
    assert first == [main_request(mix, limits, 7, n).row() for n in range(50)]
    assert first != [main_request(mix, limits, 8, n).row() for n in range(50)]
    tenants = [main_request(mix, limits, 1, n).tenant for n in range(2600)]
    hot, cold = tenants.count("hot"), [tenants.count(f"cold-{k}") for k in (1, 2, 3)]
    assert 8 < hot / statistics.mean(cold) < 12.5  # 10x, from a fixed seed


def test_mixed_lengths_are_log_uniform_from_50_to_50k_and_clamp_to_the_context():
    mix = load_mix("mixed")
    wide = [main_request(mix, limits_for(mix), 0, n) for n in range(3000)]
    lengths = [s.prompt_tokens for s in wide]
    assert min(lengths) >= 50 and max(lengths) <= 50000
    assert not any(s.clamped for s in wide)
    # log-uniform: a third of the draws in each decade-ish band; median near sqrt(50 * 50000)
    assert 1100 < statistics.median(lengths) < 2300
    assert 0.28 < sum(1 for n in lengths if n < 500) / len(lengths) < 0.38

    smol = [main_request(mix, limits_for(mix, context=8192), 0, n) for n in range(3000)]
    for wide_spec, spec in zip(wide, smol):
        assert spec.requested_prompt_tokens == wide_spec.prompt_tokens  # same draws
        assert spec.prompt_tokens + spec.max_tokens <= 8192
        too_long = spec.requested_prompt_tokens + spec.max_tokens > 8192
        assert spec.clamped == too_long
        if too_long:
            assert spec.prompt_tokens == 8192 - spec.max_tokens
    assert 0.2 < sum(s.clamped for s in smol) / len(smol) < 0.35  # ln(50k/8k)/ln(1000)


def test_agent_asks_for_the_rest_of_the_context_and_tiny_prompts_are_raised_to_the_floor():
    mix = load_mix("agent-never-stops")
    specs = [main_request(mix, limits_for(mix, context=8192), 0, n) for n in range(200)]
    agents = [s for s in specs if s.workload == "agent"]
    assert agents and all(s.prompt_tokens + s.max_tokens == 8192 for s in agents)
    chat = [s for s in specs if s.workload == "chat"]
    assert 0.65 < len(chat) / len(specs) < 0.85  # weight 3 : 1
    floor = [main_request(mix, limits_for(mix, base=300), 0, n) for n in range(200)]
    raised = [s for s in floor if s.requested_prompt_tokens < 300]
    assert raised and all(s.prompt_tokens == 300 and s.raised for s in raised)
    assert not any(s.clamped for s in floor) and not any(s.raised for s in specs)


def test_schedule_bounds_and_arrivals():
    mix = load_mix("long-prompt-flood")
    limits = limits_for(mix)
    schedule = Schedule(mix, limits, 0, "poisson", rate=4.0, burstiness=1.0, duration_s=60,
                        requests=0)
    arrivals = []
    while (item := schedule.next_timed_main()) is not None:
        arrivals.append(item[0])
    assert arrivals == sorted(arrivals) and arrivals[-1] < 60
    assert 200 < len(arrivals) < 280  # 4/s for 60 s
    assert schedule.burst_requests == 6  # a user each in the Locust process
    bursts = []
    while (item := schedule.next_burst()) is not None:
        bursts.append((item[0], item[1].workload, item[1].burst))
    assert [b[0] for b in bursts] == [20.0] * 3 + [40.0] * 3  # every 20 s, 3 at once, < 60 s
    assert all(b[1] == "flood" for b in bursts)
    assert schedule.issued == len(arrivals) + 6
    lengths = [main_request(mix, limits, 0, n) for n in range(5)]
    assert all(s.workload == "chat" for s in lengths)  # flood has weight 0: bursts only

    capped = Schedule(mix, limits, 0, "closed", 1, 1, duration_s=60, requests=4)
    assert [capped.next_closed(0.0).index for _ in range(2)] == [0, 1]
    assert [capped.next_burst()[1].index for _ in range(2)] == [2, 3]
    assert capped.next_burst() is None and capped.next_closed(0.0) is None  # 4 in all

    counted = Schedule(load_mix("chat"), limits_for(load_mix("chat")), 0, "closed", 1, 1, 0, 5)
    taken = [counted.next_closed(0.0) for _ in range(7)]
    assert [s.index for s in taken[:5]] == [0, 1, 2, 3, 4] and taken[5:] == [None, None]
    timed = Schedule(load_mix("chat"), limits_for(load_mix("chat")), 0, "closed", 1, 1, 10, 0)
    assert timed.next_closed(9.9) is not None and timed.next_closed(10.0) is None

    bursty = Schedule(mix, limits, 0, "bursty", rate=4.0, burstiness=0.25, duration_s=600,
                      requests=0)
    gaps = []
    last = 0.0
    while (item := bursty.next_timed_main()) is not None:
        gaps.append(item[0] - last)
        last = item[0]
    assert 0.2 < statistics.mean(gaps) < 0.3  # the same mean rate...
    assert statistics.pstdev(gaps) > 1.5 * statistics.mean(gaps)  # ...but clumped (cv 2)


def test_prompt_text_has_the_planned_number_of_units():
    book = PromptBook(words=["w1", "w2", "w3"], word_tokens=2, pads={1: "."},
                      system={"a": None}, base={"a": 40})
    text = book.user_text("a", 47, random.Random(0))  # 7 = 3 words of 2 + a 1-token pad
    assert text.startswith(HEADER) and text.endswith(".")
    assert len(text[len(HEADER):].split()) == 3
    assert book.user_text("a", 40, random.Random(0)) == HEADER
    assert book.user_text("a", 1040, random.Random(1)) != book.user_text("a", 1040,
                                                                        random.Random(2))
    with pytest.raises(ValueError, match="minimum"):
        book.user_text("a", 39, random.Random(0))
