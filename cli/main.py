"""The `rankguard` command line: one console script, a sub-command per part."""

import typer

from .agent import agent
from .checkpoints import app as checkpoints_app
from .dashboards import app as dashboards_app
from .inject import inject
from .supervisor import health, incidents, ranks, supervisor
from .trainer import app as trainer_app
from .up import up

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="rankguard: keep large-model training alive on GPU clusters.",
)
app.add_typer(trainer_app, name="trainer")
app.command("up")(up)
app.command("agent")(agent)
app.command("supervisor")(supervisor)
app.command("health")(health)
app.command("ranks")(ranks)
app.command("incidents")(incidents)
app.command("inject")(inject)
app.add_typer(checkpoints_app, name="checkpoints")
app.add_typer(dashboards_app, name="dashboards")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
