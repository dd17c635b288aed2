"""`tokstream top` (under construction: issue 8)."""

import typer


def top():
    """A live TUI of a running server (under construction)."""
    typer.echo("error: tokstream top is not built yet", err=True)
    raise typer.Exit(1)
