"""The `tokstream` command as a user runs it: real subprocesses, stdout vs stderr, exit codes."""

import json
import subprocess
import sys

import pytest


def run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "tokstream", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.startup
def test_generate_answers_on_stdout():
    result = run("generate", "What is the capital of France?", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."


@pytest.mark.startup
def test_generate_raw_prompt_on_dummy_model_with_logs_on_stderr():
    result = run("generate", "--no-chat", "hello", "--model", "dummy:tiny", "--max-tokens", "5",
                 "-v")
    assert result.returncode == 0, result.stderr
    assert "finish_reason=length" in result.stderr and "output_tokens=5" in result.stderr
    assert "finish_reason" not in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--model", "dummy:nope"], "dummy:nope"),
])
@pytest.mark.startup
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = run("generate", "hi", *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


@pytest.mark.startup
def test_corrupt_gguf_and_too_long_prompt(tmp_path):
    from tokstream.model.source import embedded_gguf_path

    truncated = tmp_path / "cut.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        truncated.write_bytes(f.read(1_000_000))
    result = run("generate", "hi", "--model", str(truncated))
    assert result.returncode == 2 and "truncated" in result.stderr and "Traceback" not in result.stderr
    garbage = tmp_path / "junk.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    result = run("generate", "hi", "--model", str(garbage))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    result = run("generate", "word " * 9000)
    assert result.returncode == 2 and "context" in result.stderr and "Traceback" not in result.stderr


def test_plan_json_has_the_contract_keys():
    result = run("plan", "--model", "dummy:llama-70b", "--tp", "2", "--device-memory", "80GB",
                 "--dtype", "float16", "--avg-context", "2000", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    for key in ("weights_bytes", "weights_bytes_per_device", "kv_bytes_per_token",
                "kv_cache_bytes", "max_cached_tokens", "max_concurrent_requests"):
        assert key in plan
    assert 135e9 < plan["weights_bytes"] < 142e9
    assert plan["kv_bytes_per_token"] == 327680
    assert 55_000 < plan["max_cached_tokens"] < 70_000
    assert 27 <= plan["max_concurrent_requests"] <= 35
    refused = run("plan", "--model", "smollm2", "--tp", "2")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr


@pytest.mark.startup
def test_bench_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "--model", "dummy:tiny", "--num-requests", "6", "--input-len", "20",
                 "--output-len", "8", "--concurrency", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["output_tokens"] == 48
    for key in ("output_tokens_per_s", "total_tokens_per_s"):
        assert data[key] > 0
    for key in ("step_ms", "ttft_s", "itl_s"):
        assert set(data[key]) >= {"p50", "p90", "p99"}
        assert data[key]["p50"] <= data[key]["p99"]


@pytest.mark.startup
def test_bench_sweep_writes_the_curve(tmp_path):
    out = tmp_path / "sweep.json"
    result = run("bench", "--model", "dummy:tiny", "--num-requests", "4", "--input-len", "12",
                 "--output-len", "4", "--sweep", "1,4", "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["sweep"] == "max-num-seqs" and [p["value"] for p in data["points"]] == [1, 4]
    for point in data["points"]:
        assert point["output_tokens_per_s"] > 0
        assert point["itl_s"]["p50"] <= point["itl_s"]["p99"]
        assert point["ttft_s"]["p50"] <= point["ttft_s"]["p99"]
    png = tmp_path / "sweep.png"
    assert data["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args", [["--sweep", "1,x"], ["--sweep", "0"],
                                  ["--sweep", "2", "--sweep-param", "nope"],
                                  ["--no-chunked-prefill", "--max-prefill-chunk", "8"]])
@pytest.mark.startup
def test_bench_bad_dials_are_one_line_and_exit_2(args):
    result = run("bench", "--model", "dummy:tiny", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# Every flag serve took before its flags were generated from the config dataclasses.
SERVE_FLAGS_BEFORE = (
    "--model -m --dtype --weights --device --tp --spare --no-spare --spare-core --no-spare-core "
    "--step-timeout --max-recovery-attempts --max-request-failures --start-timeout "
    "--down-retry-interval --shutdown-timeout --host --port --served-model-name "
    "--kv-cache-memory --num-blocks --block-size --kv-cache-dtype --prefix-caching "
    "--no-prefix-caching --max-num-seqs --max-num-batched-tokens --chunked-prefill "
    "--no-chunked-prefill --max-prefill-chunk --itl-target-ms --preemption-mode --swap-space "
    "--max-waiting-requests --max-waiting-tokens --max-pending-tokens --slow-client-grace "
    "--ping-interval --public-load-metrics --no-public-load-metrics --stream-integrity "
    "--no-stream-integrity --max-body-bytes --tenants --profile --insecure --allowed-hosts "
    "--allowed-origins --header-timeout --body-timeout --max-connections --descriptor-reserve "
    "--demux-mutation --verbose -v").split()


def help_rows(text: str) -> dict[str, str]:
    """{each option name: its row's text, wrapped lines joined} from a rich --help screen."""
    rows: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("│"):
            current = None  # a panel's border
            continue
        cells = line.strip("│ ").split()
        if cells and cells[0].startswith("-"):
            current = list(cells)
            for name in cells:
                if not name.startswith("-"):
                    break
                rows[name] = current
        elif current is not None:
            current.extend(cells)
    return {name: " ".join(cells) for name, cells in rows.items()}


def test_serve_help_shows_the_dataclass_defaults_for_every_field():
    import dataclasses
    import os
    import re

    from tokstream.plan import parse_size
    from tokstream.settings import FLAG_NAMES, NESTED, SECTIONS

    result = subprocess.run([sys.executable, "-m", "tokstream", "serve", "--help"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    rows = help_rows(result.stdout)
    hidden = {"--demux-mutation"}
    assert set(SERVE_FLAGS_BEFORE) - hidden <= set(rows), set(SERVE_FLAGS_BEFORE) - set(rows)
    checked = 0
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            if field.name in NESTED or field.name == "demux_mutation":
                continue
            flag = FLAG_NAMES.get(field.name, ("--" + field.name.removesuffix("_s")
                                               .replace("_", "-"),))[0]
            assert flag in rows, f"[{section}] {field.name} has no flag {flag}"
            default = (field.default if field.default is not dataclasses.MISSING
                       else field.default_factory())
            shown = re.search(r"\[default: \(?([^)\]]*)\)?\]", rows[flag])
            if default is None:
                assert shown is None, rows[flag]
                continue
            assert shown, f"{flag} shows no default: {rows[flag]}"
            text = shown.group(1)
            if isinstance(default, bool):
                assert text == ("on" if default else "off"), (flag, text)
            elif field.metadata.get("unit") == "bytes":
                assert parse_size(text) == default, (flag, text)
            elif isinstance(default, (int, float)):
                assert float(text) == default, (flag, text)
            elif isinstance(default, list):
                assert text == (",".join(default) or "none"), (flag, text)
            else:
                assert text == default, (flag, text)
            assert len(rows[flag].split("[default:")[0].split()) > 3, f"{flag} has no help"
            checked += 1
    assert checked > 50


def command_defaults(*path: str) -> dict:
    """{parameter: its default} of a `tokstream` subcommand, as its flags hold them."""
    import typer.main

    from tokstream.cli import app

    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {param.name: param.default for param in command.params}


def test_generate_flags_default_to_the_sampling_params_but_greedy():
    import dataclasses

    from tokstream.sampling_params import SamplingParams

    defaults = command_defaults("generate")
    greedy = dataclasses.replace(SamplingParams(), temperature=0.0)  # README: default 0
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert defaults[name] == getattr(greedy, name), name
    assert not defaults["stop"]


@pytest.mark.parametrize("path,options,no_flag,param_names,stated_elsewhere", [
    (("chaos", "kill-rank"), "tokstream.chaos.options", {"experiment", "rank"},
     {"step_timeout_s": "step_timeout", "timeout_s": "timeout"}, {}),
    (("loadtest",), "tokstream.loadgen.options", set(),
     {"request_timeout_s": "request_timeout", "drain_timeout_s": "drain_timeout"},
     {"web_port": "WEB_PORT"}),  # Options.web_port None is the UI off (--web's default)
])
def test_chaos_and_loadtest_flags_default_to_their_options_dataclass(
        path, options, no_flag, param_names, stated_elsewhere):
    import dataclasses
    import importlib

    module = importlib.import_module(options)
    defaults = command_defaults(*path)
    checked = 0
    for field in dataclasses.fields(module.Options):
        if field.name in no_flag:
            continue
        param = param_names.get(field.name, field.name)
        assert param in defaults, f"{field.name} has no flag"
        expected = (getattr(module, stated_elsewhere[field.name])
                    if field.name in stated_elsewhere else field.default)
        assert defaults[param] == expected, (field.name, defaults[param], expected)
        checked += 1
    assert checked > 12
