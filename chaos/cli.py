"""`tokstream chaos EXPERIMENT`: fault experiments against a real server, checked by the
stream-history checker. Exit 0 only if every invariant held; 1 if one broke; 2 on bad input."""

from __future__ import annotations

import signal
import sys
from typing import Optional

import typer

# The flags come from the run's options (tokstream/options.py: one declaration each, the field);
# both modules are light.
from tokstream.chaos.options import Options
from tokstream.options import config_flags, field_help, with_flags

app = typer.Typer(help="Fault experiments against a real server, with a stream-history checker.",
                  no_args_is_help=True)

CHAOS_FLAGS = config_flags("chaos", Options, skip={"experiment", "rank"},
                           names={"model": ("--model", "-m")}, holds_default=True,
                           own_panel=False)
"""One flag per Options field but the experiment (the subcommand) and the rank (an argument),
each holding its field's default: nothing lies between these flags and Options."""
JSON = typer.Option(None, "--json", help="Write the report here.")


def _run(experiment: str, rank: Optional[int], given: dict, json_path: Optional[str]) -> None:
    from rich.console import Console

    from tokstream.chaos.report import render, write_json
    from tokstream.chaos.runner import run
    from tokstream.errors import UserInputError

    # SIGTERM unwinds like Ctrl-C, so the server chaos started is stopped in order (a killed
    # chaos still takes it down: the server gets SIGTERM when its parent dies).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = run(Options(experiment, rank, **given))
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
    if with_rank:
        @with_flags(CHAOS_FLAGS)
        def command(rank: int = typer.Argument(..., help=field_help(Options, "rank")),
                    flags: dict = None, json_path: Optional[str] = JSON):
            _run(name, rank, flags["chaos"], json_path)
    else:
        @with_flags(CHAOS_FLAGS)
        def command(flags: dict = None, json_path: Optional[str] = JSON):
            _run(name, None, flags["chaos"], json_path)

    command.__doc__ = doc
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
