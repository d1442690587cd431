"""scripts/run installs once, with progress on screen, and skips pip while nothing it
installs from has changed; it says how to put `rankguard` on PATH. Run in a copy of the
layout it needs, with a stand-in .venv (its pip and rankguard record their calls)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp: Path) -> Path:
    repo = tmp / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "run", repo / "scripts" / "run")
    (repo / "pyproject.toml").write_text('[project]\nname = "rankguard"\n')
    (repo / "setup.py").write_text("")
    bin_ = repo / ".venv" / "bin"
    bin_.mkdir(parents=True)
    stubs = {
        "python": 'if [ "${1:-}" = -V ]; then echo "Python 3.11.0"; fi',
        "pip": f'echo "pip $*" >>"{tmp}/calls"; echo "Downloading torch ... 100%"',
        "rankguard": f'echo "rankguard $*" >>"{tmp}/calls"',
    }
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    return repo


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(repo / "scripts" / "run"), *args], capture_output=True,
                          text=True, timeout=60, cwd="/")  # fmt: skip


def test_the_install_runs_once_and_again_only_when_pyproject_changes(tmp_path):
    repo = _checkout(tmp_path)
    calls = tmp_path / "calls"
    first = _run(repo, "--steps", "5")
    assert first.returncode == 0, first.stderr
    assert "installing rankguard and torch" in first.stderr
    assert "--progress-bar on" in calls.read_text() and "-q" not in calls.read_text().split()
    assert calls.read_text().splitlines()[-1] == "rankguard up --steps 5"
    assert f". {repo}/.venv/bin/activate" in first.stderr  # rankguard on PATH: one line
    calls.unlink()
    second = _run(repo)
    assert second.returncode == 0, second.stderr
    assert calls.read_text().splitlines() == ["rankguard up"], calls.read_text()  # no pip
    assert "up to date" in second.stderr
    calls.unlink()
    (repo / "pyproject.toml").write_text('[project]\nname = "rankguard"\nversion = "2"\n')
    third = _run(repo)
    assert third.returncode == 0 and calls.read_text().startswith("pip install"), third.stderr


def test_a_venv_on_the_machines_own_torch_keeps_it(tmp_path):
    """A .venv that sees the system's packages (made so where python3 has torch: a
    cluster's CUDA build) installs rankguard without pinning torch, and says which it uses."""
    repo = _checkout(tmp_path)
    (repo / ".venv" / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    (repo / ".venv" / "bin" / "python").write_text(
        '#!/usr/bin/env bash\nif [ "${1:-}" = -V ]; then echo "Python 3.11.0"; '
        'elif [ "${1:-}" = -c ]; then echo "2.9.0+cu128"; fi\n'
    )
    run = _run(repo)
    assert run.returncode == 0, run.stderr
    assert "using the machine's torch 2.9.0+cu128" in run.stderr, run.stderr
    pip = (tmp_path / "calls").read_text().splitlines()[0]
    assert pip.startswith("pip install") and "torch==" not in pip, pip
