import pytest
from rich.console import Console

from tokstream.errors import UserInputError
from tokstream.model.presets import dummy_config
from tokstream.plan import compute_plan, parse_size, render_plan


@pytest.mark.parametrize("text, size", [
    ("80GB", 80 * 10**9), ("80 gb", 80 * 10**9), ("1.5TB", 1_500_000_000_000),
    ("512MB", 512 * 10**6), ("4KB", 4000), ("100B", 100), ("123", 123), ("0", 0),
    ("80GiB", 80 * 2**30), ("512MiB", 512 * 2**20), ("1KiB", 1024), ("2TiB", 2 * 2**40),
    (4096, 4096),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "80XB", "eighty", "-5GB", "1e9", "80 G B", "nan"])
def test_parse_size_rejects_bad_input_naming_it(text):
    with pytest.raises(UserInputError, match="size"):
        parse_size(text)
    with pytest.raises(UserInputError) as raised:
        parse_size(text)
    assert repr(text) in str(raised.value)


def test_llama_70b_on_two_80gb_devices():
    plan = compute_plan(dummy_config("llama-70b"), tp=2, device_memory=parse_size("80GB"),
                        dtype="float16", avg_context=2000)
    assert 137e9 <= plan["weights_bytes"] <= 140e9
    assert plan["weights_bytes_per_device"] * 2 >= plan["weights_bytes"]
    assert plan["kv_bytes_per_token"] == 327680
    assert plan["kv_cache_bytes"] == 2 * (80 * 10**9 - plan["weights_bytes_per_device"])
    assert 60_000 <= plan["max_cached_tokens"] <= 70_000
    assert plan["max_cached_tokens"] == plan["kv_cache_bytes"] // 327680
    assert 30 <= plan["max_concurrent_requests"] <= 35
    assert plan["fits"] and plan["note"] is None
    assert {"model", "tp", "dtype", "device_memory_bytes", "avg_context"} <= set(plan)


def test_reserve_comes_off_every_device():
    config = dummy_config("llama-70b")
    base = compute_plan(config, 2, parse_size("80GB"), "float16", 2000)
    reserved = compute_plan(config, 2, parse_size("80GB"), "float16", 2000, reserve=10**9)
    assert base["kv_cache_bytes"] - reserved["kv_cache_bytes"] == 2 * 10**9


def test_weights_that_do_not_fit_give_zero_and_a_note():
    plan = compute_plan(dummy_config("llama-70b"), 1, parse_size("80GB"), "float16", 2000)
    assert not plan["fits"]
    assert plan["kv_cache_bytes"] == plan["max_cached_tokens"] == 0
    assert plan["max_concurrent_requests"] == 0
    assert "per device" in plan["note"] and "\n" not in plan["note"]


def test_smollm2_kv_bytes_per_token():
    config = dummy_config("smollm2-135m")
    assert compute_plan(config, 1, 10**9, "float32", 100)["kv_bytes_per_token"] == 46080
    assert compute_plan(config, 1, 10**9, "bfloat16", 100)["kv_bytes_per_token"] == 23040
    assert compute_plan(config, 3, 10**9, "bfloat16", 100)["tp"] == 3


@pytest.mark.parametrize("tp", [2, 4, 0, -1])
def test_tp_must_divide_heads(tp):
    # SmolLM2: 9 query heads, 3 KV heads.
    with pytest.raises(UserInputError, match="tp"):
        compute_plan(dummy_config("smollm2-135m"), tp, 10**9, "float32", 100)


@pytest.mark.parametrize("kwargs", [
    {"device_memory": 0}, {"avg_context": 0}, {"reserve": -1}, {"dtype": "int3"},
])
def test_bad_arguments_are_user_errors(kwargs):
    args = {"config": dummy_config("tiny"), "tp": 1, "device_memory": 10**9,
            "dtype": "float32", "avg_context": 100, **kwargs}
    with pytest.raises(UserInputError):
        compute_plan(**args)


def test_render_plan_shows_readable_units():
    plan = compute_plan(dummy_config("llama-70b"), 2, parse_size("80GB"), "float16", 2000)
    console = Console(width=100, record=True)
    console.print(render_plan(plan))
    text = console.export_text()
    assert "137.95 GB" in text and "327,680 B" in text and "67,281" in text
    failing = compute_plan(dummy_config("llama-70b"), 1, parse_size("80GB"), "float16", 2000)
    console.print(render_plan(failing))
    assert "raise --tp" in console.export_text()
