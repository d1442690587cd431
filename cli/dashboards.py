"""`rankguard dashboards build`: write the Grafana dashboards and the Prometheus rules.

Generation is pure (`rankguard.dashboards.build.render_all`); this module only writes
files or compares them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..dashboards import build as gen

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2

app = typer.Typer(
    no_args_is_help=True,
    help="Grafana dashboards and Prometheus rules for rankguard's metrics.",
)


@app.command("build")
def build_cmd(
    out: Annotated[
        Path,
        typer.Option(
            "--out", help="Directory to write into (created if missing).", show_default=False
        ),
    ],
    check: Annotated[
        bool,
        typer.Option("--check", help="Write nothing; exit 1 if any file under OUT differs."),
    ] = False,
) -> None:
    """Write OUT/grafana/rankguard-*.json (import into Grafana: Dashboards > New > Import,
    choose the Prometheus data source) and OUT/prometheus/: rankguard-rules.yml (list it under
    rule_files), rankguard-rules.test.yml (`promtool test rules`), an example prometheus.yml
    and example file_sd target lists.

    Exit codes: 0 written (or, with --check, up to date); 1 with --check, some file differs
    or is missing; 2 OUT cannot be written.
    """
    files = gen.render_all()
    if check:
        stale = gen.differences(out, files)
        for rel in stale:
            typer.echo(f"differs: {out / rel}", err=True)
        if stale:
            typer.echo(
                f"rankguard dashboards build: run `rankguard dashboards build --out {out}`",
                err=True,
            )
            raise typer.Exit(EXIT_DIFFERENT)
        typer.echo(f"{len(files)} files up to date under {out}")
        raise typer.Exit(EXIT_OK)
    try:
        written = gen.write(out, files)
    except OSError as exc:
        typer.echo(f"rankguard dashboards build: cannot write under {out}: {exc}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    for path in written:
        typer.echo(str(path))
