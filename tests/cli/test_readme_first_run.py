"""The README's first run, as a new user types it: in a fresh copy of the repository, a
clean shell (no venv active, no PYTHONPATH) runs its setup command on a terminal, and a
second shell, from another directory, activates the venv, sources the run's env.sh and
runs its health, ranks, incidents and inject commands. Real: scripts/run builds .venv/
and installs into it (pip, from the index this machine is configured with), `rankguard
up` trains under torchrun, Ctrl-C ends it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from up_run import Pty, left_running

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def readme_commands() -> list[str]:
    """Every command line of the README's `sh` blocks, comments dropped."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command:
                lines.append(command)
    return lines


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked files (what a clone has), nothing built."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def clean_env() -> dict:
    """A login shell's environment: the machine's python3 first on PATH (not the suite's
    venv), pip's and TLS settings kept (where this machine's index is), nothing of
    rankguard's or of a venv."""
    python_dir = str(Path(sys._base_executable).parent)
    keep = {k: v for k, v in os.environ.items()
            if k.startswith("PIP_") or k.endswith(("_CA_BUNDLE", "_CERT_FILE", "_CERT_DIR"))}  # fmt: skip
    return {**keep, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
            "TERM": "xterm-256color", "PATH": f"{python_dir}:/usr/local/bin:/usr/bin:/bin"}  # fmt: skip


def shell(line: str, cwd: Path, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs the repository's git checkout to copy what a clone has")  # fmt: skip
def test_the_readmes_first_run_works_as_written_from_a_fresh_copy():
    commands = readme_commands()
    setup, activate = "scripts/run --steps 5000", ". .venv/bin/activate"
    queries = "rankguard health; rankguard ranks; rankguard incidents"
    inject = "rankguard inject stop --rank 1"
    for line in (setup, activate, queries, inject):
        assert line in commands, f"the README no longer says {line!r}: update this test"
    # a short path, as a user's clone: up's Unix sockets live in its run directory (a
    # path of at most 107 bytes), which pytest's own tmp_path would already exceed
    home = Path(tempfile.mkdtemp(prefix="rg-", dir="/tmp"))
    repo = fresh_copy(home / "rankguard")
    env = clean_env()
    first = Pty(["bash", "-c", setup], env, cwd=repo, controlling=True)
    run = None
    try:
        # the first run installs (pip's progress on screen), then the live view
        first.wait_for(r"installing rankguard", 60)
        first.wait_for(r"\btraining\s+\d+", 900)  # a rank training, in the live view
        (run,) = (repo / "runs").glob("up-*")
        assert (run / "env.sh").is_file()
        elsewhere = home / "elsewhere"
        elsewhere.mkdir()
        second = f". {repo}/.venv/bin/activate && . {run}/env.sh && "
        # each of the README's queries on its own line's terms: health says healthy (0) or
        # degraded (1: a 2-core machine's noise can open a straggler), never an error
        for query in queries.split("; "):
            shown = shell(second + query, elsewhere, env)
            ok = (0, 1) if query == "rankguard health" else (0,)
            assert shown.returncode in ok, query + "\n" + shown.stdout + shown.stderr
            assert "Traceback" not in shown.stderr and shown.stdout.strip(), query
        done = shell(second + inject, elsewhere, env)
        assert done.returncode == 0, done.stdout + done.stderr
        hang = r"rank_hung .*rank=1 .*\[resolved\] rankguard killed rank 1"
        deadline, listed = time.monotonic() + 120, ""
        while time.monotonic() < deadline and not re.search(hang, listed):
            time.sleep(1)
            listed = shell(second + "rankguard incidents", elsewhere, env).stdout
        assert re.search(hang, listed), listed + first.text()[-3000:]
        first.type(b"\x03")  # Ctrl-C at the first shell
        assert first.wait(60) == 130, first.text()[-3000:]
        assert left_running(run) == []
    finally:
        first.close()
        for pid in left_running(run) if run else ():
            os.kill(pid, 9)
        shutil.rmtree(home, ignore_errors=True)
