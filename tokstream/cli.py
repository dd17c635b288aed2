"""The `tokstream` command. Imports are lazy so `--help` is instant and each command pulls in
only what it needs (no torch in this process: workers import it)."""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Optional

import typer

app = typer.Typer(help="tokstream: paged-KV, continuously batched LLM serving.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

# Flags that set a config field come from the field (tokstream/options.py): its name, its
# docstring as help, its default. This import is light (typer and the dataclasses).
from tokstream.config import BenchSpec, EngineConfig  # noqa: E402
from tokstream.options import config_flags, field_help, with_flags  # noqa: E402
from tokstream.plan import PlanSpec  # noqa: E402
from tokstream.sampling_params import SamplingParams  # noqa: E402
from tokstream.settings import SERVE_FLAGS, flags_for  # noqa: E402

MODEL_FLAGS = flags_for("model", "dtype", "weights", "weight_copies_memory", "device")
"""What generate and bench take of the engine's flags."""
BENCH_FLAGS = MODEL_FLAGS + flags_for(
    "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory", "block_size", "kv_cache_dtype",
    "chunked_prefill", "max_prefill_chunk", "preemption_mode", "swap_space")
WORKLOAD_FLAGS = config_flags("bench", BenchSpec)
GENERATE_SAMPLING = SamplingParams(temperature=0.0)
"""generate's flag defaults: the library's, but greedy, so one prompt always gives one text."""


def _setup_logging(verbose: bool) -> None:
    import os

    from tokstream import envs

    level = "INFO" if verbose else "WARNING"
    os.environ.setdefault(envs.LOG.name, level)  # what the engine core and ranks log
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")


def user_errors(func):
    """Bad input ends the command with one clear line on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from tokstream.errors import TokstreamError

        try:
            return func(*args, **kwargs)
        except TokstreamError as exc:
            from tokstream.errors import UserInputError

            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2 if isinstance(exc, UserInputError) else 1)
        except KeyboardInterrupt:
            raise typer.Exit(130)

    return wrapper


@app.command()
@with_flags(MODEL_FLAGS)
@user_errors
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user message unless --no-chat)."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Apply the model's chat template."),
    max_tokens: int = typer.Option(GENERATE_SAMPLING.max_tokens,
                                   help=field_help(SamplingParams, "max_tokens")),
    temperature: float = typer.Option(GENERATE_SAMPLING.temperature,
                                      help=field_help(SamplingParams, "temperature")),
    top_p: float = typer.Option(GENERATE_SAMPLING.top_p,
                                help=field_help(SamplingParams, "top_p")),
    top_k: int = typer.Option(GENERATE_SAMPLING.top_k, help=field_help(SamplingParams, "top_k")),
    seed: Optional[int] = typer.Option(GENERATE_SAMPLING.seed,
                                       help=field_help(SamplingParams, "seed")),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log to stderr."),
    flags: dict = None,
):
    """Generate one completion without a server; the text streams to stdout."""
    _setup_logging(verbose)
    from tokstream.engine.llm import LLM
    from tokstream.settings import build_settings

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=list(stop))
    config, _ = build_settings({}, flags)
    _check_prompt_fits(config, prompt, chat)
    with LLM(config) as llm:
        request = llm.request(prompt, params, chat=chat)
        for delta in llm.stream([request]):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.finished:
                logging.getLogger("tokstream").info(
                    "finish_reason=%s prompt_tokens=%d output_tokens=%d", delta.finish_reason,
                    delta.num_prompt_tokens, delta.num_output_tokens)
    sys.stdout.write("\n")


def _check_prompt_fits(config, prompt: str, chat: bool) -> None:
    """Fail fast, before any worker starts, on a prompt the model cannot take."""
    from tokstream.errors import PromptTooLongError
    from tokstream.model.source import resolve_model
    from tokstream.text.tokenizer import load_tokenizer

    source = resolve_model(config.model)
    tokenizer = load_tokenizer(source)
    ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
           else tokenizer.encode(prompt))
    if len(ids) >= source.config.max_position:
        raise PromptTooLongError(
            f"prompt is {len(ids)} tokens; the model's context is {source.config.max_position} "
            "tokens, leaving no room for output")


@app.command()
@with_flags(BENCH_FLAGS + WORKLOAD_FLAGS)
@user_errors
def bench(
    sweep: Optional[str] = typer.Option(None, help="Comma-separated values of --sweep-param "
                                        "(e.g. 1,2,4,8,16,32): one run per value, output "
                                        "tokens/s against ITL and TTFT, JSON and a PNG."),
    sweep_param: str = typer.Option("max-num-seqs", help="The dial --sweep turns: "
                                    "max-num-seqs or token-budget."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the results here."),
    png_path: Optional[str] = typer.Option(None, "--png", help="With --sweep: the curve's PNG "
                                           "(default: the --json path with .png, else "
                                           "bench-sweep.png)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
    flags: dict = None,
):
    """Offline throughput and latency of the engine alone, on random prompts. Without
    --max-num-seqs, at least --concurrency sequences run at once."""
    _setup_logging(verbose)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tokstream.bench import fit_concurrency, run_bench
    from tokstream.config import BenchSpec
    from tokstream.engine.llm import LLM
    from tokstream.settings import build_settings

    workload = {k: v for k, v in flags.pop("bench").items() if v is not None}
    values = _parse_sweep(sweep, sweep_param) if sweep else None
    if values and sweep_param == "max-num-seqs":
        # enough callers to fill the largest batch
        workload["concurrency"] = max(workload.get("concurrency", BenchSpec.concurrency),
                                      *values)
    spec = BenchSpec(**workload)
    config, _ = build_settings({}, flags)
    if flags["scheduler"]["max_num_seqs"] is None:
        fit_concurrency(config, spec)
    num_requests, output_len = spec.num_requests, spec.output_len
    console = Console(stderr=True)
    if values:
        _bench_sweep(config, spec, sweep_param, values, json_path, png_path, console)
        return
    with LLM(config) as llm:
        with Progress(TextColumn("bench"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task("tokens", total=num_requests * output_len)
            result = run_bench(llm, spec, on_token=lambda n: progress.advance(task, n))
    _print_bench(console, result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)


def _parse_sweep(text: str, param: str) -> list[int]:
    from tokstream.bench import SWEEP_PARAMS
    from tokstream.errors import UserInputError

    if param not in SWEEP_PARAMS:
        raise UserInputError(f"--sweep-param must be one of {', '.join(SWEEP_PARAMS)}, "
                             f"not {param!r}")
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserInputError(f"--sweep must be comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise UserInputError("--sweep needs at least one value, each >= 1")
    return values


def _bench_sweep(config, spec, param, values, json_path, png_path, console) -> None:
    import os

    from rich.table import Table

    from tokstream.bench import plot_sweep, run_sweep
    from tokstream.engine.llm import LLM

    if param == "max-num-seqs":
        config.scheduler.max_num_seqs = max(values)  # the pool is sized for the largest
    table = Table(title=f"sweep over {param}: {spec.num_requests} x {spec.input_len}->"
                        f"{spec.output_len}, {spec.concurrency} callers")
    for column in (param, "out tok/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 s", "TTFT p99 s"):
        table.add_column(column, justify="right")

    def add_row(point):
        console.print(f"{param}={point['value']}: {point['output_tokens_per_s']:.1f} output "
                      "tokens/s")
        table.add_row(str(point["value"]), f"{point['output_tokens_per_s']:.1f}",
                      *(f"{point[key][q] * scale:.1f}" if scale == 1000 else
                        f"{point[key][q]:.2f}" for key, scale in (("itl_s", 1000),
                                                                  ("ttft_s", 1))
                        for q in ("p50", "p99")))

    with LLM(config) as llm:
        result = run_sweep(llm, spec, param, values, on_point=add_row)
    console.print(table)
    png_path = png_path or (os.path.splitext(json_path)[0] + ".png" if json_path
                            else "bench-sweep.png")
    plot_sweep(result, png_path)
    result["png"] = png_path
    console.print(f"curve: {png_path}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)


def _print_bench(console, result: dict) -> None:
    from rich.table import Table

    table = Table(title=f"bench: {result['model']} {result['dtype']} "
                        f"{result['num_requests']} x {result['input_len']}->{result['output_len']}"
                        f" at concurrency {result['concurrency']}")
    table.add_column("metric")
    for col in ("p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for key, scale, unit in (("ttft_s", 1000, "ms"), ("itl_s", 1000, "ms"), ("step_ms", 1, "ms")):
        row = result[key]
        table.add_row(f"{key.split('_')[0]} ({unit})",
                      *(f"{row[c] * scale:.1f}" if row[c] is not None else "-"
                        for c in ("p50", "p90", "p99")))
    console.print(table)
    console.print(f"output tokens/s {result['output_tokens_per_s']:.1f}   "
                  f"total tokens/s {result['total_tokens_per_s']:.1f}   "
                  f"elapsed {result['elapsed_s']:.2f} s   preemptions {result['preemptions']}")


@app.command()
@with_flags(config_flags("plan", PlanSpec))
@user_errors
def plan(
    model: str = typer.Option(EngineConfig.model, "--model", "-m",
                              help=field_help(EngineConfig, "model")),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    flags: dict = None,
):
    """Memory-ceiling arithmetic: weights, KV bytes per token, tokens and requests that fit."""
    from tokstream.model.source import resolve_model
    from tokstream.plan import compute_plan, parse_size, render_plan

    spec = PlanSpec(**{k: v for k, v in flags["plan"].items() if v is not None})
    config = resolve_model(model).config
    result = compute_plan(config, spec.tp, parse_size(spec.device_memory), spec.dtype,
                          spec.avg_context, parse_size(spec.reserve))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        Console().print(render_plan(result))


@app.command()
@with_flags(SERVE_FLAGS)
@user_errors
def serve(
    profile: Optional[str] = typer.Option(None, "--profile", help="Serving preset: a name in profiles/ (cpu-smollm2, ci, gpu-llama-8b) or a TOML file; flags override it."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log to stderr."),
    flags: dict = None,
):
    """Start the streaming gateway: Anthropic and OpenAI APIs over the engine. Each flag in the
    panels below is also a key of a serving profile, in the section its panel names
    (--step-timeout: step_timeout_s under engine)."""
    _setup_logging(verbose)
    from tokstream.settings import build_settings, load_profile

    preset = load_profile(profile) if profile else {}
    engine_config, server_config = build_settings(preset, flags)
    from tokstream.server.startup import run

    run(engine_config, server_config, log_level="info" if verbose else "warning")


@app.command("hash-key")
def hash_key_command(key: str = typer.Argument(..., help="An API key to store in a tenants file.")):
    """Print the sha256 hex a tenants file stores for KEY (key_sha256 / admin_key_sha256)."""
    from tokstream.server.access.tenants import hash_key

    typer.echo(hash_key(key))


# Each of these modules imports only typer and its options' dataclass at the top, so
# `tokstream --help` stays instant.
from tokstream.chaos.cli import app as _chaos_app  # noqa: E402
from tokstream.loadgen.cli import loadtest as _loadtest  # noqa: E402
from tokstream.top.cli import top as _top  # noqa: E402

app.add_typer(_chaos_app, name="chaos")
app.command("loadtest")(_loadtest)
app.command("top")(_top)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
