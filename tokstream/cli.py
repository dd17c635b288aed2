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

ModelOpt = typer.Option("smollm2", "--model", "-m",
                        help="smollm2 (embedded), a .gguf file, a Hugging Face folder, or dummy:NAME")
DtypeOpt = typer.Option("auto", help="float32, bfloat16, float16 or auto (bfloat16 where the CPU or GPU has native bfloat16 matmuls, else float32)")
DeviceOpt = typer.Option("cpu", help="cpu or cuda")
WeightsOpt = typer.Option("auto", help="native (a GGUF's quantised blocks, CPU), float32, "
                          "bfloat16, float16 (dequantised), or auto: native where it applies.")
KV_CACHE_DTYPE_HELP = ("auto (default: float16 on a CPU computing in float32, where decode "
                       "attention is bound by the bytes it reads; else the serving dtype), "
                       "float16 (CPU, float32 compute), or the serving dtype.")


def _setup_logging(verbose: bool) -> None:
    import os

    level = "INFO" if verbose else "WARNING"
    os.environ.setdefault("TOKSTREAM_LOG", level)
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
@user_errors
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user message unless --no-chat)."),
    model: str = ModelOpt,
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Apply the model's chat template."),
    max_tokens: int = typer.Option(256, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 = no limit."),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    dtype: str = DtypeOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log to stderr."),
):
    """Generate one completion without a server; the text streams to stdout."""
    _setup_logging(verbose)
    from tokstream.config import EngineConfig
    from tokstream.engine.llm import LLM
    from tokstream.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=list(stop))
    config = EngineConfig(model=model, dtype=dtype, weights=weights, device=device)
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
    from tokstream.tokenizer import load_tokenizer

    source = resolve_model(config.model)
    tokenizer = load_tokenizer(source)
    ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
           else tokenizer.encode(prompt))
    if len(ids) >= source.config.max_position:
        raise PromptTooLongError(
            f"prompt is {len(ids)} tokens; the model's context is {source.config.max_position} "
            "tokens, leaving no room for output")


@app.command()
@user_errors
def bench(
    model: str = ModelOpt,
    num_requests: int = typer.Option(32, min=1),
    input_len: int = typer.Option(128, min=1),
    output_len: int = typer.Option(128, min=1),
    concurrency: int = typer.Option(32, min=1),
    dtype: str = DtypeOpt,
    weights: str = WeightsOpt,
    device: str = DeviceOpt,
    max_num_batched_tokens: int = typer.Option(1024, help="Token budget per step."),
    max_num_seqs: Optional[int] = typer.Option(None, help="Most running sequences "
                                               "(default: at least the concurrency)."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV pool size, e.g. 2GB "
                                                  "(default: 4 GiB on CPU)."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    kv_cache_dtype: str = typer.Option("auto", help=KV_CACHE_DTYPE_HELP),
    chunked_prefill: bool = typer.Option(True, "--chunked-prefill/--no-chunked-prefill",
                                         help="Chunk prompts under the token budget (off: "
                                         "each prompt is prefilled whole in one step)."),
    max_prefill_chunk: int = typer.Option(0, min=0, help="Most prompt tokens of one request "
                                          "per step (0 = the token budget)."),
    preemption_mode: str = typer.Option("recompute", help="recompute or swap (to host memory)."),
    swap_space: str = typer.Option("4GiB", help="Host memory for swapped-out KV (swap mode)."),
    seed: int = typer.Option(0),
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
):
    """Offline throughput and latency of the engine alone, on random prompts."""
    _setup_logging(verbose)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tokstream.bench import BenchSpec, bench_config, run_bench
    from tokstream.engine.llm import LLM

    from tokstream.config import CacheConfig, SchedulerConfig
    from tokstream.plan import parse_size

    values = _parse_sweep(sweep, sweep_param) if sweep else None
    if values and sweep_param == "max-num-seqs":
        concurrency = max(concurrency, *values)  # enough callers to fill the largest batch
    spec = BenchSpec(num_requests, input_len, output_len, concurrency, seed)
    cache = CacheConfig(block_size=block_size, kv_cache_memory=(
        parse_size(kv_cache_memory) if kv_cache_memory else None),
        preemption_mode=preemption_mode, swap_space=parse_size(swap_space),
        kv_cache_dtype=kv_cache_dtype)
    scheduler = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                chunked_prefill=chunked_prefill,
                                max_prefill_chunk=max_prefill_chunk)
    config = bench_config(model, dtype, device, spec, cache=cache, scheduler=scheduler,
                          weights=weights)
    if max_num_seqs is not None:
        config.scheduler.max_num_seqs = max_num_seqs
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
@user_errors
def plan(
    model: str = ModelOpt,
    tp: int = typer.Option(1, min=1),
    device_memory: str = typer.Option("80GB", help="Memory per device (decimal: 80GB = 80e9 B)."),
    dtype: str = typer.Option("float16"),
    avg_context: int = typer.Option(2000, min=1, help="Average tokens per request."),
    reserve: str = typer.Option("0", help="Memory kept back per device (activations, etc.)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Memory-ceiling arithmetic: weights, KV bytes per token, tokens and requests that fit."""
    from tokstream.model.source import resolve_model
    from tokstream.plan import compute_plan, parse_size, render_plan

    config = resolve_model(model).config
    result = compute_plan(config, tp, parse_size(device_memory), dtype, avg_context,
                          parse_size(reserve))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        Console().print(render_plan(result))


# serve's help states defaults from the dataclass, not typed twice; this import is light.
from tokstream.config import SchedulerConfig as _SCHEDULER_DEFAULTS  # noqa: E402


@app.command()
@user_errors
def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="smollm2 (embedded, the default), a .gguf file, a Hugging Face folder, or dummy:NAME"),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16 or auto (default)"),
    weights: Optional[str] = typer.Option(None, help="native (a GGUF's quantised blocks, CPU), float32, bfloat16, float16 (dequantised), or auto (default: native where it applies)."),
    device: Optional[str] = typer.Option(None, help="cpu (default) or cuda"),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel ranks, one process each (default 1; must divide the model's query and KV heads)."),
    spare: Optional[bool] = typer.Option(None, "--spare/--no-spare", help="Keep a standby rank group loaded, so a rank failure swaps groups instead of starting processes (default off)."),
    spare_core: Optional[bool] = typer.Option(None, "--spare-core/--no-spare-core", help="Keep a second engine core loaded (with its own rank group), so an engine-core death swaps cores instead of starting one (default off)."),
    step_timeout: Optional[float] = typer.Option(None, help="Seconds a step may take before a rank counts as hung and the group is replaced (default 120)."),
    max_recovery_attempts: Optional[int] = typer.Option(None, help="Failed restarts in a row (rank group or engine core) before the replica is down (default 3)."),
    max_request_failures: Optional[int] = typer.Option(None, help="A request in flight at this many replica failures in a row is ended with an error and the replica goes on without it (default 3)."),
    start_timeout: Optional[float] = typer.Option(None, help="Seconds an engine core or rank group may take to start before it counts as hung: killed, a failed attempt (default 300)."),
    down_retry_interval: Optional[float] = typer.Option(None, help="While down, seconds between further tries to start an engine core (default 10)."),
    shutdown_timeout: Optional[float] = typer.Option(None, help="On SIGTERM, seconds open streams may run to their end while new requests are refused; the rest then end with an error event (default 30)."),
    host: Optional[str] = typer.Option(None, help="Address to bind (default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="Port (default 8000; 0 picks a free one)."),
    served_model_name: Optional[str] = typer.Option(None, help="Model id clients send (default: the --model value)."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV pool size, e.g. 2GiB (default: a share of free memory, at most 4 GiB on CPU)."),
    num_blocks: Optional[int] = typer.Option(None, help="Exact KV pool size in blocks (overrides --kv-cache-memory)."),
    block_size: Optional[int] = typer.Option(None, help="Tokens per KV block (default 16)."),
    kv_cache_dtype: Optional[str] = typer.Option(None, help=KV_CACHE_DTYPE_HELP),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching", help="Share cached KV blocks of identical prompt prefixes (default on)."),
    max_num_seqs: Optional[int] = typer.Option(None, help="Most sequences in a step's batch (default 64)."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="Token budget per step (default 1024)."),
    chunked_prefill: Optional[bool] = typer.Option(None, "--chunked-prefill/--no-chunked-prefill", help="Chunk prompts under the token budget (default on; off: each prompt is prefilled whole)."),
    max_prefill_chunk: Optional[int] = typer.Option(None, help="Most prompt tokens of one request per step (default 0 = the token budget)."),
    itl_target_ms: Optional[float] = typer.Option(None, "--itl-target-ms", help=f"Inter-token latency target: while streams decode, each step carries only the prefill its measured step cost predicts fits under it (default {_SCHEDULER_DEFAULTS.itl_target_ms:g}; 0 = off)."),
    preemption_mode: Optional[str] = typer.Option(None, help="recompute (default) or swap (preempted KV to host memory)."),
    swap_space: Optional[str] = typer.Option(None, help="Host memory for swapped-out KV, e.g. 4GiB (default; swap mode)."),
    max_waiting_requests: Optional[int] = typer.Option(None, help="Admission: most requests waiting for their first token (default 256)."),
    max_waiting_tokens: Optional[int] = typer.Option(None, help="Admission: most prompt tokens waiting (default 262144)."),
    max_pending_tokens: Optional[int] = typer.Option(None, help="Unread tokens past which a slow client's request is cancelled (default 4096)."),
    slow_client_grace: Optional[float] = typer.Option(None, help="Seconds a client may read nothing (a send stays blocked) before it is cut off, whatever the request's state (default 30)."),
    ping_interval: Optional[float] = typer.Option(None, help="Seconds between SSE pings on an idle stream (default 5)."),
    public_load_metrics: Optional[bool] = typer.Option(None, "--public-load-metrics/--no-public-load-metrics", help="With a tenants file, a caller with no key may read /metrics without the series that name tenants (what a Gateway API endpoint picker reads; it sends no credentials). Default off."),
    stream_integrity: Optional[bool] = typer.Option(None, "--stream-integrity/--no-stream-integrity", help="Frame every stream with the integrity extension (id: lines, comment pings on OpenAI routes) whether or not the request sends x-tokstream-integrity: 1 (default off: each route framed as the API it imitates)."),
    max_body_bytes: Optional[int] = typer.Option(None, help="Largest request body (default 4 MiB)."),
    tenants: Optional[str] = typer.Option(None, "--tenants", help="Tenants TOML file (API key hashes, limits, admin key)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Serving preset: a name in profiles/ (cpu-smollm2, ci, gpu-llama-8b) or a TOML file; flags override it."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback bind without API keys."),
    allowed_hosts: Optional[str] = typer.Option(None, help="Comma-separated Host names clients may use besides loopback names and IP literals (.example.com: subdomains too; *: any). Others get 403 (DNS rebinding)."),
    allowed_origins: Optional[str] = typer.Option(None, help="Comma-separated web origins allowed to call the API from a browser (CORS; default none; *: any)."),
    header_timeout: Optional[float] = typer.Option(None, help="Seconds a client has to send a complete request head (default 10; slowloris)."),
    body_timeout: Optional[float] = typer.Option(None, help="Seconds a client has to send a request body (default 30)."),
    max_connections: Optional[int] = typer.Option(None, help="Open client connections at most; more get 503 (default 0: the descriptor limit less --descriptor-reserve)."),
    descriptor_reserve: Optional[int] = typer.Option(None, help="File descriptors kept back from client connections for the engine (default 128)."),
    demux_mutation: Optional[str] = typer.Option(None, hidden=True, help="TEST ONLY: corrupt one token in the demux (drop|repeat|swap|misroute[,...]); refused with --tenants or a public --host."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log to stderr."),
):
    """Start the streaming gateway: Anthropic and OpenAI APIs over the engine."""
    _setup_logging(verbose)
    from tokstream.server.config import load_profile
    from tokstream.server.settings import build_settings

    preset = load_profile(profile) if profile else {}
    flags = {
        "engine": {"model": model, "dtype": dtype, "weights": weights, "device": device,
                   "tp": tp, "spare": spare, "spare_core": spare_core,
                   "step_timeout_s": step_timeout,
                   "max_recovery_attempts": max_recovery_attempts,
                   "max_request_failures": max_request_failures,
                   "start_timeout_s": start_timeout},
        "cache": {"kv_cache_memory": kv_cache_memory, "num_blocks": num_blocks,
                  "block_size": block_size, "enable_prefix_caching": prefix_caching,
                  "kv_cache_dtype": kv_cache_dtype,
                  "preemption_mode": preemption_mode,
                  "swap_space": swap_space},
        "scheduler": {"max_num_seqs": max_num_seqs,
                      "max_num_batched_tokens": max_num_batched_tokens,
                      "chunked_prefill": chunked_prefill,
                      "max_prefill_chunk": max_prefill_chunk,
                      "itl_target_ms": itl_target_ms},
        "server": {"host": host, "port": port, "served_model_name": served_model_name,
                   "tenants_file": tenants, "insecure": insecure or None,
                   "max_pending_tokens": max_pending_tokens, "ping_interval_s": ping_interval,
                   "stream_integrity": stream_integrity,
                   "public_load_metrics": public_load_metrics,
                   "slow_client_grace_s": slow_client_grace,
                   "max_body_bytes": max_body_bytes, "down_retry_s": down_retry_interval,
                   "shutdown_timeout_s": shutdown_timeout,
                   "allowed_hosts": allowed_hosts, "allowed_origins": allowed_origins,
                   "header_timeout_s": header_timeout, "body_timeout_s": body_timeout,
                   "max_connections": max_connections,
                   "descriptor_reserve": descriptor_reserve, "demux_mutation": demux_mutation},
        "admission": {"max_waiting_requests": max_waiting_requests,
                      "max_waiting_tokens": max_waiting_tokens},
    }
    engine_config, server_config = build_settings(preset, flags)
    from tokstream.server.app import run

    run(engine_config, server_config, log_level="info" if verbose else "warning")


@app.command("hash-key")
def hash_key_command(key: str = typer.Argument(..., help="An API key to store in a tenants file.")):
    """Print the sha256 hex a tenants file stores for KEY (key_sha256 / admin_key_sha256)."""
    from tokstream.server.tenants import hash_key

    typer.echo(hash_key(key))


# Each of these modules imports only typer at the top, so `tokstream --help` stays instant.
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
