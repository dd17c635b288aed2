"""`tokstream loadtest`: Locust-driven workload mixes against a running server."""

import dataclasses

import typer

# The flags come from the run's options (tokstream/options.py: one declaration each, the field);
# both modules are light.
from tokstream.loadgen.options import WEB_PORT, Options
from tokstream.options import config_flags, with_flags

LOADTEST_FLAGS = config_flags("loadtest", Options, skip={"web_port"})
"""One flag per Options field but web_port (--web and --web-port set it)."""


def options_from(given: dict, web: bool, web_port: int) -> Options:
    """The run's Options from the flags (None: not given, the field's default applies)."""
    values = {name: value for name, value in given.items() if value is not None}
    return Options(**values, web_port=web_port if web else None)


@with_flags(LOADTEST_FLAGS)
def loadtest(
    web: bool = typer.Option(False, "--web", help="Open Locust's web UI on 127.0.0.1 while the run goes."),
    web_port: int = typer.Option(WEB_PORT, help="Port of Locust's web UI."),
    flags: dict = None,
):
    """Load a server with a workload mix (Locust in its own process), or sweep it from one
    request at a time to capacity (--sweep); report to the terminal, report.json and PNG plots
    in --out. Exit 1 when errors or integrity failures pass the thresholds, 2 on bad input."""
    from tokstream.errors import UserInputError
    from tokstream.loadgen.loadtest import run

    try:
        code = run(options_from(flags["loadtest"], web, web_port))
    except UserInputError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        raise typer.Exit(130)
    raise typer.Exit(code)
