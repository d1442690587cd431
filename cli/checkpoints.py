"""`rankguard checkpoints ...` (placeholder, filled in by the checkpoint-store work)."""

import typer

app = typer.Typer(no_args_is_help=True, help="Inspect and verify training checkpoints.")
