"""Run the real trainer under real torchrun (shared by the test modules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(
    url: str, timeout: float = 5, body: dict | None = None, token: str | None = None
) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode())
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except OSError:
            pass
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


RANKGUARD = [sys.executable, "-m", "rankguard.cli.main"]


class Daemon:
    """A `rankguard` daemon as a real subprocess, its log kept for failure messages."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        url: str,
        env: dict | None = None,
        command: list[str] | None = None,
        cwd: Path | None = None,
    ):
        """`command`: how to run `rankguard` (default: this interpreter's module; an
        installed console script in tests/test_packaging.py); `env` adds to os.environ."""
        self.url, self.log = url, log
        with open(log, "w") as out:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [*(command or RANKGUARD), *args], cwd=cwd,
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            )  # fmt: skip
        wait_until(lambda: self.proc.poll() is None and http_json(url + "/healthz")["ok"], 60,
                   f"{args[0]} to serve ({log})")  # fmt: skip

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


TOKEN = "test-token-0123456789abcdef"


def start_agent(
    tmp: Path, name: str = "node-a", extra: list[str] | None = None, **daemon_kw
) -> Daemon:
    token = tmp / "token"
    if not token.exists():
        token.write_text(TOKEN)
        token.chmod(0o600)
    port = free_port()
    d = Daemon(
        ["agent", "--bind", f"127.0.0.1:{port}", "--interval", "1", "--token-file", str(token),
         "--telemetry-socket", str(tmp / f"{name}.sock"), "--node", name, *(extra or [])],
        tmp / f"agent-{name}.log", f"http://127.0.0.1:{port}", **daemon_kw,
    )  # fmt: skip
    d.socket = tmp / f"{name}.sock"
    return d


def start_supervisor(
    tmp: Path, agent_urls: list[str], db: Path | None = None, **daemon_kw
) -> Daemon:
    port = free_port()
    args = ["supervisor", "--bind", f"127.0.0.1:{port}", "--interval", "0.25",
            "--db", str(db or tmp / "rankguard.db"), "--token-file", str(tmp / "token")]  # fmt: skip
    for url in agent_urls:
        args += ["--agents", url]
    return Daemon(args, tmp / f"supervisor-{port}.log", f"http://127.0.0.1:{port}", **daemon_kw)


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
