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


def help_screen(*command: str) -> dict[str, str]:
    """help_rows of `tokstream COMMAND --help`, wide enough that no row wraps."""
    import os

    result = subprocess.run([sys.executable, "-m", "tokstream", *command, "--help"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    return help_rows(result.stdout)


def assert_shows_default(row: str, flag: str, field) -> None:
    """The --help row of a flag generated from a dataclass field shows the field's default
    (none for None) after some help."""
    import dataclasses
    import re

    from tokstream.plan import parse_size

    default = (field.default if field.default is not dataclasses.MISSING
               else field.default_factory())
    shown = re.search(r"\[default: \(?([^)\]]*)\)?\]", row)
    if default is None or default == "":
        assert shown is None, row
        return
    assert shown, f"{flag} shows no default: {row}"
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
    assert len(row.split("[default:")[0].split()) > 3, f"{flag} has no help"


def field_flag(name: str) -> str:
    return "--" + name.removesuffix("_s").replace("_", "-")


def test_serve_help_shows_the_dataclass_defaults_for_every_field():
    import dataclasses

    from tokstream.settings import FLAG_NAMES, NESTED, SECTIONS

    rows = help_screen("serve")
    hidden = {"--demux-mutation"}
    assert set(SERVE_FLAGS_BEFORE) - hidden <= set(rows), set(SERVE_FLAGS_BEFORE) - set(rows)
    checked = 0
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            if field.name in NESTED or field.name == "demux_mutation":
                continue
            flag = FLAG_NAMES.get(field.name, (field_flag(field.name),))[0]
            assert flag in rows, f"[{section}] {field.name} has no flag {flag}"
            assert_shows_default(rows[flag], flag, field)
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


def test_chaos_flags_default_to_their_options_dataclass():
    import dataclasses

    from tokstream.chaos.options import Options

    for experiment in ("kill-rank", "drain"):  # with and without the rank argument
        defaults = command_defaults("chaos", experiment)
        checked = 0
        for field in dataclasses.fields(Options):
            if field.name in ("experiment", "rank"):  # the subcommand and its argument
                continue
            assert field.name in defaults, f"{field.name} has no flag"
            assert defaults[field.name] == field.default, (field.name, defaults[field.name])
            checked += 1
        assert checked > 12


def test_chaos_options_are_declared_once_in_their_dataclass():
    """Every option of every experiment is its Options field's generated flag (help, default,
    env var from there) or one of the few the command itself declares; chaos/cli.py spells no
    flag but those."""
    import ast
    import dataclasses
    from pathlib import Path

    import typer.main

    from tokstream.chaos.cli import CHAOS_FLAGS
    from tokstream.chaos.options import Options
    from tokstream.cli import app
    from tokstream.options import field_help

    fields = {f.name: f for f in dataclasses.fields(Options)}
    assert {flag.field for flag in CHAOS_FLAGS} == set(fields) - {"experiment", "rank"}
    chaos = typer.main.get_command(app).commands["chaos"]
    assert len(chaos.commands) > 10
    for name, command in chaos.commands.items():
        params = {param.name: param for param in command.params}
        own = {"json_path", "help"} | ({"rank"} if "rank" in params else set())
        assert set(params) - own == {flag.field for flag in CHAOS_FLAGS}, name
        for flag in CHAOS_FLAGS:
            param = params[flag.field]
            assert param.help == field_help(Options, flag.field), (name, flag.field)
            assert param.default == fields[flag.field].default, (name, flag.field)
            assert param.envvar == fields[flag.field].metadata.get("envvar"), (name, flag.field)
        if "rank" in params:
            assert params["rank"].help == field_help(Options, "rank")
    source = Path(__file__).resolve().parents[1] / "chaos" / "cli.py"
    spelled = {node.value for node in ast.walk(ast.parse(source.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and node.value.startswith("-")}
    assert spelled == {"--json", "--model", "-m"}  # --model keeps its -m (config_flags names)
    assert {flag.names for flag in CHAOS_FLAGS if flag.field in ("admin_key", "spare")} == {
        ("--admin-key",), ("--spare/--no-spare",)}


def test_an_option_declared_twice_is_refused():
    import typer

    from tokstream.chaos.cli import CHAOS_FLAGS
    from tokstream.options import with_flags

    def command(url: str = typer.Option(None, "--url"), flags: dict = None):
        pass

    with pytest.raises(ValueError, match="clash"):
        with_flags(CHAOS_FLAGS)(command)
    with pytest.raises(ValueError, match="same name"):
        with_flags(CHAOS_FLAGS + CHAOS_FLAGS[:1])


# Every flag loadtest took before its flags were generated from loadgen/options.py.
LOADTEST_FLAGS_BEFORE = (
    "--url --mix --api --users --rate --capacity-fraction --capacity --probe-duration --sweep "
    "--sweep-rates --throughput-users --arrival --burstiness --duration --requests --seed --slo "
    "--keys --out --model --request-timeout --drain-timeout --max-error-rate "
    "--max-integrity-failures --web --web-port").split()


def test_loadtest_flags_are_its_options_fields_with_their_defaults():
    import dataclasses

    from tokstream.loadgen.cli import options_from
    from tokstream.loadgen.options import WEB_PORT, Options

    rows = help_screen("loadtest")
    assert set(LOADTEST_FLAGS_BEFORE) <= set(rows), set(LOADTEST_FLAGS_BEFORE) - set(rows)
    fields = [f for f in dataclasses.fields(Options) if f.name != "web_port"]
    for field in fields:
        assert_shows_default(rows[field_flag(field.name)], field_flag(field.name), field)
    assert f"[default: {WEB_PORT}]" in rows["--web-port"]
    # Given no flag, the run gets exactly the dataclass's defaults.
    defaults = command_defaults("loadtest")
    given = {field.name: defaults[field.name] for field in fields}
    assert options_from(given, defaults["web"], defaults["web_port"]) == Options()
    assert len(fields) > 20


def test_plan_flags_are_its_spec_fields_with_their_defaults():
    import dataclasses

    from tokstream.plan import PlanSpec, parse_size

    rows = help_screen("plan")
    for field in dataclasses.fields(PlanSpec):
        assert_shows_default(rows[field_flag(field.name)], field_flag(field.name), field)
    result = run("plan", "--model", "dummy:llama-70b", "--json")  # no flag: PlanSpec's
    assert result.returncode == 0, result.stderr
    plan, spec = json.loads(result.stdout), PlanSpec()
    assert (plan["tp"], plan["dtype"], plan["avg_context"]) == (spec.tp, spec.dtype,
                                                                  spec.avg_context)
    assert plan["device_memory_bytes"] == parse_size(spec.device_memory)
    assert plan["reserve_bytes"] == parse_size(spec.reserve)


def test_top_and_loadtest_default_to_the_url_serve_listens_on():
    from urllib.parse import urlsplit

    from tokstream.gateway_config import ServerConfig
    from tokstream.loadgen.options import Options

    # loadtest's flag is None, "not given": Options.url applies (the test above)
    for url in (command_defaults("top")["url"], Options.url):
        parts = urlsplit(url)
        assert (parts.scheme, parts.hostname, parts.port) == ("http", ServerConfig.host,
                                                              ServerConfig.port), url
