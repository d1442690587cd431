"""`rankguard up` as a child process, and what a test reads back from its run directory
(trainer log, agent ranks, the supervisor's incident database, processes left running)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


class Up:
    """`rankguard up` as a child process, its output read line by line."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None):
        self.run = tmp_path / "run"
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}
        self.proc = subprocess.Popen(
            [sys.executable, *DEFAULT_SIGINT, "-m", "rankguard.cli.main", "up", "--nproc", "2",
             "--run-dir", str(self.run), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def output(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def agent_url(self, timeout: float = 60) -> str:
        return self._url("agent", timeout)

    def supervisor_url(self, timeout: float = 60) -> str:
        return self._url("supervisor", timeout)

    def _url(self, daemon: str, timeout: float) -> str:
        """The daemon's URL from `rankguard up`'s first line ("| agent URL | supervisor URL")."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(rf"\| {daemon} (http://\S+)", "".join(self.out))
            if m:
                return m.group(1)
            assert self.proc.poll() is None, self.output()
            time.sleep(0.1)
        raise AssertionError(f"no {daemon} URL in the output: {self.output()}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()  # up ends what it started
                self.proc.wait(timeout=60)
        for t in self._threads:
            t.join(timeout=10)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def log_has(up: Up, pattern: str, timeout: float) -> None:
    log = up.run / "trainer.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and re.search(pattern, log.read_text(errors="replace")):
            return
        assert up.proc.poll() is None, up.output()
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in the trainer log: {log.read_text()[-2000:]}")


def agent_rank(url: str, job: str, rank: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/v1/ranks", timeout=5) as resp:
            ranks = json.loads(resp.read())["ranks"]
        for r in ranks:
            if (r["job"], r["rank"], r["state"]) == (job, rank, "alive"):
                return r
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} of job {job} never seen alive by the agent: {ranks}")


def read_incidents(run: Path) -> list[dict]:
    with sqlite3.connect(run / "rankguard.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM incidents ORDER BY id")]


def left_running(run: Path) -> list[int]:
    """PIDs of processes that `up` started for this run (they carry its telemetry socket
    path in their environment), found by reading /proc; none should outlive it."""
    marker = f"RANKGUARD_TELEMETRY_SOCKET={run / 'telemetry.sock'}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker in env.split(b"\0") and state not in "ZX":
            pids.append(int(name))
    return pids


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


# A terminal's Ctrl-C reaches a foreground `up`. A test run as a background job of a
# script inherits SIGINT ignored (POSIX, without job control) and Python keeps an
# inherited SIG_IGN, so `up` would never see the test's SIGINT: exec it with the default.
DEFAULT_SIGINT = ["-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]  # fmt: skip


class Pty:
    """A command on a pseudo-terminal (its stdin, stdout and stderr a tty, as in a shell),
    in its own session, the terminal's output read continuously (a full pty would block
    the command's writes). With `controlling`, the terminal is its session's controlling
    one, as a shell's: Ctrl-C typed there (`type(b"\x03")`) signals its foreground group."""

    def __init__(self, argv: list[str], env: dict, cwd: Path | None = None, columns: int = 160,
                 controlling: bool = False):  # fmt: skip
        import fcntl
        import struct
        import termios

        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))

        def own_terminal() -> None:  # in the child, before exec
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
            start_new_session=not controlling, preexec_fn=own_terminal if controlling else None,
        )  # fmt: skip
        os.close(slave)
        self._master = master
        self._raw = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                return
            if not chunk:
                return
            self._raw += chunk

    def type(self, keys: bytes) -> None:
        """Keys typed at the terminal (b"\x03": Ctrl-C, sent to its foreground group)."""
        os.write(self._master, keys)

    def text(self) -> str:
        """Everything shown so far, escape sequences removed."""
        return ANSI.sub("", self._raw.decode(errors="replace"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            assert self.proc.poll() is None, self.text()[-4000:]
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} never shown: {self.text()[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()
            self._thread.join(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


class UpPty(Pty):
    """`rankguard up` on a pseudo-terminal."""

    def __init__(self, tmp_path: Path, *args: str, columns: int = 160):
        self.run = tmp_path / "run"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color"}
        env.pop("COLUMNS", None)
        super().__init__(
            [sys.executable, *DEFAULT_SIGINT, "-m", "rankguard.cli.main", "up", "--nproc", "2",
             "--run-dir", str(self.run), *args],
            env, columns=columns,
        )  # fmt: skip

    def close(self) -> None:
        super().close()  # up ends what it started (its SIGTERM handler)
        for pid in left_running(self.run):  # a safety net: tests assert there are none
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
