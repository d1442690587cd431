"""Run the real trainer under real torchrun (shared by the test modules)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rankguard.cli.local_stack import (  # noqa: F401  (the tests take them from here)
    RANKGUARD,
    TOKEN,
    Daemon,
    free_port,
    http_json,
    start_agent,
    start_supervisor,
    wait_until,
)


def trainer_command(
    args: list[str],
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    env: dict | None = None,
    entry: tuple[str, ...] = ("rankguard.trainer",),
    deterministic: bool = True,
) -> tuple[list[str], dict]:
    """The command and environment of `torchrun --standalone` of the bundled trainer
    (`entry`: the module and its first arguments). Deterministic kernels by default, as the
    digest comparisons of exact resume need them on a GPU."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": "off"}
    full_env.update(env or {})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "-m", *entry, "--preset", "tiny", "--log-every", "0",
        *(["--deterministic"] if deterministic else []), *args,
    ]  # fmt: skip
    return cmd, full_env


def torchrun(
    args: list[str], *, cwd: Path, timeout: float = 240, **kw
) -> subprocess.CompletedProcess:
    """`trainer_command` run to completion, output captured for assertions."""
    cmd, env = trainer_command(args, **kw)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_ok(args: list[str], **kw) -> subprocess.CompletedProcess:
    proc = torchrun(args, **kw)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc


def run_in_own_session(cmd: list[str], *, env: dict, cwd: Path, timeout: float) -> tuple[int, str]:
    """(exit code, stdout and stderr together) of `cmd` run in a session of its own: on a
    timeout its whole process tree (torchrun and its ranks) is killed by the group id, and
    what it wrote so far is kept."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    return proc.returncode, output


def closing_fixture(make):
    """A test's rig as a fixture: `make(tmp_path)` (what starts the rig's processes), its
    `close()` called after the test; the module names it (`rig = closing_fixture(Rig)`)."""

    @pytest.fixture
    def fixture(tmp_path):
        with contextlib.closing(make(tmp_path)) as rig:
            yield rig

    return fixture


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def check_sd_notify_lifecycle(
    tmp: Path, args: list[str], env: dict | None = None, watchdog_prefix: str = "WATCHDOG=1"
) -> None:
    """Run `rankguard ARGS` as systemd would (Type=notify): READY=1 once serving, watchdog
    pings (`watchdog_prefix`), STOPPING=1 on SIGTERM and a clean exit, all through
    $NOTIFY_SOCKET."""
    import socket

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify.sock"))
    notify.settimeout(30)
    full_env = {**os.environ, "NOTIFY_SOCKET": str(tmp / "notify.sock"), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "rankguard.cli.main", *args], env=full_env,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        messages = [notify.recv(4096).decode() for _ in range(3)]
        assert messages[0].startswith("READY=1"), messages
        assert all(m.startswith(watchdog_prefix) for m in messages[1:]), messages
        proc.terminate()
        while not (m := notify.recv(4096).decode()).startswith("STOPPING=1"):
            assert m.startswith("WATCHDOG=1"), m
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        notify.close()
