"""The `rankguard` command line: one console script, a sub-command per part.

A command's module is imported only when that command runs (or for the full help): the
daemons and queries start without the others' imports (grafanalib, the checkpoint store),
about 0.6 s of CPU each time a process starts."""

import importlib
import sys
from typing import Annotated

import typer

# name: (module in this package, attribute, a group of sub-commands or one command)
COMMANDS: dict[str, tuple[str, str, bool]] = {
    "trainer": ("trainer", "app", True),
    "up": ("up", "up", False),
    "launch": ("launch", "launch", False),
    "agent": ("agent", "agent", False),
    "supervisor": ("supervisor", "supervisor", False),
    "health": ("supervisor", "health", False),
    "ranks": ("supervisor", "ranks", False),
    "incidents": ("supervisor", "incidents", False),
    "inject": ("inject", "inject", False),
    "rendezvous": ("rendezvous", "rendezvous", False),
    "checkpoints": ("checkpoints", "app", True),
    "dashboards": ("dashboards", "app", True),
    "deploy": ("deploy", "app", True),
    "snapshot-holder": ("snapshot_holder", "app", True),
}


def _print_version(value: bool) -> None:
    if value:
        from rankguard.service.version import VERSION

        typer.echo(f"rankguard {VERSION}")
        raise typer.Exit()


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


def build(only: str | None = None) -> typer.Typer:
    """The command line with every command, or with `only` that one (the one to run)."""
    cli = typer.Typer(
        no_args_is_help=True,
        rich_markup_mode="markdown",
        add_completion=False,
        help="rankguard: keep large-model training alive on GPU clusters.",
    )
    cli.callback()(_root)
    for name, (module, attribute, group) in COMMANDS.items():
        if only is not None and name != only:
            continue
        target = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        if group:
            cli.add_typer(target, name=name)
        else:
            cli.command(name)(target)
    return cli


def main() -> None:
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    build(command if command in COMMANDS else None)()


if __name__ == "__main__":
    main()
