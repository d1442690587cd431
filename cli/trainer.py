"""`rankguard trainer ...`: the bundled trainer's tooling (data preparation).

Torch and numpy are imported inside the commands, never at module import, so
`rankguard --help` and the other sub-commands stay fast and torch-free.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="The bundled torchrun trainer: data preparation.")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@app.command()
def prepare(
    texts: Annotated[
        list[Path],
        typer.Argument(
            help="Text files to tokenize, in order (byte-level, vocab 256).", show_default=False
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output directory (created; a previous prepared corpus there is replaced).",
            show_default=False,
        ),
    ],
    shard_tokens: Annotated[
        int, typer.Option("--shard-tokens", min=1, help="Tokens (bytes) per shard file.")
    ] = 64 * 2**20,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the written index as JSON.")
    ] = False,
) -> None:
    """Tokenize text files into memory-mappable uint8 shards plus index.json.

    Documents are joined with a 0 byte. Exit 0 on success, 2 on bad input.
    """
    from ..trainer.data import DataError, prepare_corpus

    last_shown = [-1]

    def progress(done: int, total: int) -> None:
        pct = 100 * done // total if total else 100
        # One line per 10% when not a terminal; a live line on a terminal.
        if sys.stderr.isatty():
            typer.echo(
                f"\rreading {_human_bytes(done)} / {_human_bytes(total)} ({pct}%)",
                err=True,
                nl=False,
            )
            if done >= total:
                typer.echo("", err=True)
        elif pct // 10 != last_shown[0]:
            last_shown[0] = pct // 10
            typer.echo(f"reading {_human_bytes(done)} / {_human_bytes(total)} ({pct}%)", err=True)

    try:
        index = prepare_corpus(texts, out, shard_tokens=shard_tokens, progress=progress)
    except DataError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except OSError as e:
        typer.echo(f"error: {e.strerror or e} ({e.filename or out})", err=True)
        raise typer.Exit(2) from None

    if as_json:
        typer.echo(json.dumps({"out_dir": str(out), **index}, indent=2))
        return
    n = len(index["shards"])
    typer.echo(
        f"prepared {index['total_tokens']:,} tokens from {len(texts)} file(s) into "
        f"{n} shard{'s' if n != 1 else ''} in {out}"
    )
