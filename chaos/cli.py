"""`tokstream chaos EXPERIMENT` (under construction: issue 6)."""

import typer

app = typer.Typer(help="Fault experiments against a real server, with a stream-history checker.",
                  no_args_is_help=True)
