"""Gateway pieces without a server: the bounded channel merges and signals its limit,
admission bounds, the tenant token bucket, profile and flag merging."""

import pytest

from tokstream.engine.messages.request import RequestDelta
from tokstream.errors import UserInputError
from tokstream.gateway_config import AdmissionConfig, ServerConfig
from tokstream.server.access.gateway_admission import Admission
from tokstream.server.api_errors import ApiError
from tokstream.settings import build_settings, load_profile
from tokstream.server.streaming.streams import Channel
from tokstream.server.access.tenants import Tenant, hash_key


def delta(index, text="x", finish=None):
    return RequestDelta("r", [100 + index], index, text, finish_reason=finish, step_id=index + 1)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_channel_merges_while_the_reader_lags_and_reports_its_limit():
    channel = Channel(max_pending_tokens=3)
    assert channel.put(delta(0)) and channel.put(delta(1)) and channel.put(delta(2))
    assert not channel.put(delta(3))  # past the limit: the registry cancels the request
    batch = channel.take()
    assert batch.token_ids == [100, 101, 102, 103] and batch.indices == [0, 1, 2, 3]
    assert batch.step_ids == [1, 2, 3, 4] and batch.text == "xxxx"
    assert channel.num_pending_tokens == 0 and not channel.ready.is_set()
    channel.put(delta(4, finish="length"))
    assert channel.take().ended


def test_admission_bounds_requests_and_tokens():
    admission = Admission(AdmissionConfig(max_waiting_requests=2, max_waiting_tokens=100))
    admission.check(60)
    admission.enter(60)
    with pytest.raises(ApiError) as refused:
        admission.check(50)
    assert refused.value.error_type == "overloaded_error"
    assert refused.value.status_for("openai") == 503 and refused.value.status == 529
    assert refused.value.retry_after >= 1
    admission.check(40)
    admission.enter(40)
    with pytest.raises(ApiError):
        admission.check(1)
    admission.leave(60, 0.5)
    admission.leave(40, 0.5)
    assert admission.waiting_requests == 0 and admission.waiting_tokens == 0
    admission.check(1000)  # alone, a big prompt is let in: the engine bounds it


def test_tenant_bucket_and_concurrency():
    tenant = Tenant("t", hash_key("k"), tokens_per_minute=100, max_concurrent=2)
    tenant.admit(60)
    tenant.admit(30)
    with pytest.raises(ApiError) as refused:
        tenant.admit(1)
    assert refused.value.error_type == "rate_limit_error"
    tenant.settle(max_tokens=0, num_output_tokens=0)
    with pytest.raises(ApiError) as refused:
        tenant.admit(40)  # 10 tokens left
    assert refused.value.retry_after >= 1


def test_profiles_load_and_flags_win():
    preset = load_profile("ci")
    engine, server = build_settings(preset, {"scheduler": {"max_num_seqs": 3},
                                             "server": {"port": 0}})
    assert engine.model == "dummy:tiny" and engine.scheduler.max_num_seqs == 3
    assert engine.cache.num_blocks == 512 and server.port == 0
    for name in ("cpu-smollm2", "gpu-llama-8b"):
        engine, _ = build_settings(load_profile(name), {})
        assert engine.model in ("smollm2", "dummy:llama-8b")
    with pytest.raises(UserInputError):
        load_profile("nope")
    with pytest.raises(UserInputError):
        build_settings({"scheduler": {"bogus": 1}}, {})
    with pytest.raises(UserInputError):
        ServerConfig(host="0.0.0.0").check_bind()
    ServerConfig(host="0.0.0.0", insecure=True).check_bind()


def test_serving_profiles_set_only_what_differs_from_the_defaults():
    """A default lives in its dataclass: a profile restating one would drift from it (the
    model a preset is for is named even when it is the default)."""
    import dataclasses
    from pathlib import Path

    from tokstream.options import field_default
    from tokstream.settings import PROFILE_DIR, SECTIONS

    root = Path(__file__).resolve().parents[1]
    paths = sorted(PROFILE_DIR.glob("*.toml")) + [root / "deploy/k8s/serve.toml"]
    assert len(paths) >= 4
    for path in paths:
        for section, values in load_profile(str(path)).items():
            defaults = {f.name: field_default(f) for f in dataclasses.fields(SECTIONS[section])}
            restated = {key for key, value in values.items()
                        if key != "model" and defaults[key] == value}
            assert not restated, f"{path.name} [{section}] restates defaults: {restated}"
