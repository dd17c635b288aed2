"""`tokstream chaos EXPERIMENT`: fault experiments against a real server, checked by the
stream-history checker. Exit 0 only if every invariant held; 1 if one broke; 2 on bad input."""

from __future__ import annotations

import signal
import sys
from typing import Optional

import typer

# The defaults and help come from the run's options (one declaration each); the module is light.
from tokstream.chaos.options import Options
from tokstream.options import field_help

app = typer.Typer(help="Fault experiments against a real server, with a stream-history checker.",
                  no_args_is_help=True)

URL = typer.Option(None, "--url", help=field_help(Options, "url"))
ADMIN_KEY = typer.Option(None, "--admin-key", envvar="TOKSTREAM_ADMIN_KEY",
                         help=field_help(Options, "admin_key"))
API_KEY = typer.Option(None, "--api-key", envvar="TOKSTREAM_API_KEY",
                       help=field_help(Options, "api_key"))
MODEL = typer.Option(Options.model, "--model", "-m", help=field_help(Options, "model"))
DEVICE = typer.Option(Options.device, "--device", help=field_help(Options, "device"))
DTYPE = typer.Option(None, "--dtype", help=field_help(Options, "dtype"))
TP = typer.Option(None, "--tp", help=field_help(Options, "tp"))
SPARE = typer.Option(Options.spare, "--spare/--no-spare", help=field_help(Options, "spare"))
STREAMS = typer.Option(None, "--streams", help=field_help(Options, "streams"))
MAX_TOKENS = typer.Option(Options.max_tokens, "--max-tokens",
                          help=field_help(Options, "max_tokens"))
REPEAT = typer.Option(Options.repeat, "--repeat", help=field_help(Options, "repeat"))
SEED = typer.Option(Options.seed, "--seed", help=field_help(Options, "seed"))
STEP_TIMEOUT = typer.Option(Options.step_timeout_s, "--step-timeout",
                            help=field_help(Options, "step_timeout_s"))
TIMEOUT = typer.Option(Options.timeout_s, "--timeout", help=field_help(Options, "timeout_s"))
JSON = typer.Option(None, "--json", help="Write the report here.")


def _run(experiment: str, rank: Optional[int], url, admin_key, api_key, model, device, dtype,
         tp, spare, streams, max_tokens, repeat, seed, step_timeout, timeout, json_path) -> None:
    from rich.console import Console

    from tokstream.chaos.report import render, write_json
    from tokstream.chaos.runner import run
    from tokstream.errors import UserInputError

    # SIGTERM unwinds like Ctrl-C, so the server chaos started is stopped in order (a killed
    # chaos still takes it down: the server gets SIGTERM when its parent dies).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        options = Options(experiment, rank, url, admin_key, api_key, model, device, dtype, tp,
                          spare, streams, max_tokens, repeat, seed, step_timeout, timeout)
        report = run(options)
    except UserInputError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted: the server chaos started is stopped", err=True)
        raise typer.Exit(130)
    if json_path:
        write_json(report, json_path)
    # Piped or in CI, rich would wrap the tables at 80 columns.
    render(report, Console(width=None if sys.stdout.isatty() else 120))
    raise typer.Exit(0 if report["ok"] else 1)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _command(name: str, doc: str, with_rank: bool):
    """One subcommand per experiment, all with the same options."""
    def command(url: Optional[str] = URL, admin_key: Optional[str] = ADMIN_KEY,
                api_key: Optional[str] = API_KEY, model: str = MODEL, device: str = DEVICE,
                dtype: Optional[str] = DTYPE, tp: Optional[int] = TP, spare: bool = SPARE,
                streams: Optional[int] = STREAMS, max_tokens: int = MAX_TOKENS,
                repeat: int = REPEAT, seed: int = SEED, step_timeout: float = STEP_TIMEOUT,
                timeout: float = TIMEOUT, json_path: Optional[str] = JSON):
        _run(name, None, url, admin_key, api_key, model, device, dtype, tp, spare,
             streams, max_tokens, repeat, seed, step_timeout, timeout, json_path)

    command.__doc__ = doc
    if with_rank:
        def ranked(rank: int = typer.Argument(..., help=field_help(Options, "rank")),
                   url: Optional[str] = URL, admin_key: Optional[str] = ADMIN_KEY,
                   api_key: Optional[str] = API_KEY, model: str = MODEL, device: str = DEVICE,
                   dtype: Optional[str] = DTYPE, tp: Optional[int] = TP, spare: bool = SPARE,
                   streams: Optional[int] = STREAMS, max_tokens: int = MAX_TOKENS,
                   repeat: int = REPEAT, seed: int = SEED, step_timeout: float = STEP_TIMEOUT,
                   timeout: float = TIMEOUT, json_path: Optional[str] = JSON):
            _run(name, rank, url, admin_key, api_key, model, device, dtype, tp, spare, streams,
                 max_tokens, repeat, seed, step_timeout, timeout, json_path)

        ranked.__doc__ = doc
        return ranked
    return command


for _name, _doc, _with_rank in (
        ("kill-rank", "SIGKILL rank N mid-batch: streams decoding, a long prompt mid-prefill.",
         True),
        ("stall-rank", "SIGSTOP rank N (a hang) and leave it to the step deadline.", True),
        ("kill-engine", "SIGKILL the engine core process.", False),
        ("hang-engine", "SIGSTOP the engine core: its heartbeat catches it.", False),
        ("disconnect-storm", "Half the clients hang up at random moments.", False),
        ("cache-exhaustion", "A KV pool far too small for the load, forcing preemption.", False),
        ("slow-client", "Clients that stop reading.", False),
        ("drain", "SIGTERM the gateway mid-stream: every stream runs to its end.", False),
        ("poison-request", "A request that kills rank 0 at every step is ended alone.", False),
        ("hang-on-start", "SIGKILL the engine core, SIGSTOP its replacement.", False),
        ("rapid-core-deaths", "SIGKILL the engine core and each replacement as it serves.",
         False),
        ("stale-prefix", "SIGKILL a rank while a waiting request holds cached prefix "
         "blocks.", False)):
    app.command(_name)(_command(_name, _doc, _with_rank))
