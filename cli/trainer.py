"""`rankguard trainer ...` (placeholder, filled in by the data work)."""

import typer

app = typer.Typer(no_args_is_help=True, help="The bundled torchrun trainer: data preparation.")
