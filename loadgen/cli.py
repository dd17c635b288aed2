"""`tokstream loadtest` (under construction: issue 7)."""

import typer


def loadtest():
    """Locust-driven mixed workloads (under construction)."""
    typer.echo("error: tokstream loadtest is not built yet", err=True)
    raise typer.Exit(1)
