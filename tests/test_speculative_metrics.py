"""Speculative decoding's settings and counters, no model (issue 34): the flags and profile
keys come from SpeculativeConfig, bad values are one clear error, and /metrics shows vLLM's
spec_decode counters from the core's snapshot."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokstream.config import SpeculativeConfig
from tokstream.errors import UserInputError
from tokstream.server.operations.metrics import Metrics
from tokstream.settings import SERVE_FLAGS, build_settings
from tokstream.state_snapshot import StateSnapshot


def test_the_flags_set_the_speculative_section_and_default_auto():
    names = {flag.names[0]: flag for flag in SERVE_FLAGS}
    assert names["--speculative"].field == "method"
    assert names["--num-speculative-tokens"].default == "4"
    engine, _ = build_settings({}, {})
    assert engine.speculative == SpeculativeConfig() and engine.speculative.method == "auto"
    engine, _ = build_settings({"speculative": {"num_speculative_tokens": 2}},
                               {"speculative": {"method": "ngram"}})
    assert engine.speculative.enabled and engine.speculative.num_speculative_tokens == 2
    engine, _ = build_settings({}, {"speculative": {"method": "off"}})
    assert not engine.speculative.enabled


@pytest.mark.parametrize("bad", [dict(method="eagle"), dict(num_speculative_tokens=0),
                                 dict(prompt_lookup_min=3, prompt_lookup_max=2)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(UserInputError):
        SpeculativeConfig(**bad)


def scrape(metrics: Metrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_metrics_carry_vllms_spec_decode_counters():
    metrics = Metrics("m")
    metrics.engine.snapshot = {"speculation": {
        "method": "ngram", "num_speculative_tokens": 3, "num_drafts": 5,
        "num_draft_tokens": 14, "num_accepted_tokens": 9,
        "accepted_per_position": [5, 3, 1], "acceptance_rate": 9 / 14}}
    families = scrape(metrics)

    def samples(name):
        return [(s.name, s.labels, s.value) for s in families[name].samples
                if s.name.endswith("_total")]

    assert samples("vllm:spec_decode_num_draft_tokens") == [
        ("vllm:spec_decode_num_draft_tokens_total", {"model_name": "m"}, 14)]
    assert samples("vllm:spec_decode_num_accepted_tokens") == [
        ("vllm:spec_decode_num_accepted_tokens_total", {"model_name": "m"}, 9)]
    assert samples("vllm:spec_decode_num_drafts")[0][2] == 5
    assert samples("vllm:spec_decode_num_accepted_tokens_per_pos") == [
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
         {"model_name": "m", "position": str(i)}, v) for i, v in enumerate([5, 3, 1])]
    assert families["vllm:spec_decode_num_draft_tokens"].type == "counter"


def test_counters_are_zero_while_off_and_the_state_snapshot_reads_them():
    metrics = Metrics("m")
    metrics.engine.snapshot = {"speculation": {"method": "off"}}
    families = scrape(metrics)
    assert families["vllm:spec_decode_num_draft_tokens"].samples[0].value == 0
    state = StateSnapshot.from_wire({"speculation": {"method": "ngram", "num_draft_tokens": 4,
                                                     "num_accepted_tokens": 3,
                                                     "acceptance_rate": 0.75}})
    assert state.speculation.acceptance_rate == 0.75
    assert StateSnapshot().speculation.method == "off"
