"""The `rankguard` command line: one console script, a sub-command per part."""

from typing import Annotated

import typer

from .agent import agent
from .checkpoints import app as checkpoints_app
from .dashboards import app as dashboards_app
from .deploy import app as deploy_app
from .inject import inject
from .rendezvous import rendezvous
from .snapshot_holder import app as snapshot_holder_app
from .supervisor import health, incidents, ranks, supervisor
from .trainer import app as trainer_app
from .up import up

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="markdown",
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
app.command("rendezvous")(rendezvous)
app.add_typer(checkpoints_app, name="checkpoints")
app.add_typer(dashboards_app, name="dashboards")
app.add_typer(deploy_app, name="deploy")
app.add_typer(snapshot_holder_app, name="snapshot-holder")


def _print_version(value: bool) -> None:
    if value:
        from rankguard.service.version import VERSION

        typer.echo(f"rankguard {VERSION}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the installed version and exit.",
        ),
    ] = False,
) -> None:
    """rankguard: keep large-model training alive on GPU clusters."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
