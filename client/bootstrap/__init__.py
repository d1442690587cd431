"""The folder `rankguard up` and the Slurm script put first on the torchrun workers'
``PYTHONPATH``: its ``sitecustomize`` starts the zero-code collective watch
(``rankguard.client.collective_watch``) in every worker, with no change to the script."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

FOLDER = str(Path(__file__).resolve().parent)


def put_on_path(environ: MutableMapping[str, str]) -> None:
    """Put this folder first on ``environ``'s ``PYTHONPATH`` (once), keeping the rest."""
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != FOLDER]
    environ["PYTHONPATH"] = os.pathsep.join([FOLDER, *rest])
