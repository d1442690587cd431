"""The `rankguard` command line: one console script, a sub-command per part."""

import typer

from .agent import agent
from .checkpoints import app as checkpoints_app
from .trainer import app as trainer_app

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="rankguard: keep large-model training alive on GPU clusters.",
)
app.add_typer(trainer_app, name="trainer")
app.command("agent")(agent)
app.add_typer(checkpoints_app, name="checkpoints")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
