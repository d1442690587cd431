"""The deployment files, shipped with the package: systemd units, an example agent.toml,
the Slurm scripts, and the generated Grafana dashboards and Prometheus rules.

`rankguard deploy path` prints where they are installed; `rankguard deploy copy DEST`
copies them out (docs/deploy.md uses /opt/rankguard/deploy).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def deploy_dir() -> Path:
    """The installed deploy folder (the checkout's deploy/ in an editable install)."""
    return Path(str(files(__name__)))


def deploy_files() -> list[str]:
    """Every deployment file, relative to `deploy_dir()`, sorted (no Python files)."""
    root = deploy_dir()
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".pyc")
    )


def is_script(rel: str) -> bool:
    """A file that starts with `#!` (the Slurm scripts): `rankguard deploy copy` makes it
    executable whatever mode the installer left it with."""
    with open(deploy_dir() / rel, "rb") as f:
        return f.read(2) == b"#!"
