"""A local agent and supervisor as real processes, on loopback ports, and a telemetry sink
(a real agent-side socket that decodes every datagram): what the test suite and the
benchmarks in bench/ start (bench/ does not import tests/, so it lives here)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ..contract.secrets import new_secret_file, write_secret_file
from ..contract.telemetry import TelemetryError, TelemetryRecord, decode


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports: held together while they are picked, so that two
    daemons started side by side never get the same one (a port released and picked
    again at once is a port the kernel may hand out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


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
        write_secret_file(token, TOKEN)
    port = free_port()
    d = Daemon(
        ["agent", "--bind", f"127.0.0.1:{port}", "--interval", "1", "--token-file", str(token),
         "--telemetry-socket", str(tmp / f"{name}.sock"), "--node", name, *(extra or [])],
        tmp / f"agent-{name}.log", f"http://127.0.0.1:{port}", **daemon_kw,
    )  # fmt: skip
    d.socket = tmp / f"{name}.sock"
    return d


def start_supervisor(
    tmp: Path,
    agent_urls: list[str],
    db: Path | None = None,
    extra: list[str] | None = None,
    **daemon_kw,
) -> Daemon:
    port = free_port()
    args = ["supervisor", "--bind", f"127.0.0.1:{port}", "--interval", "0.25",
            "--db", str(db or tmp / "rankguard.db"), "--token-file", str(tmp / "token"),
            *(extra or [])]  # fmt: skip
    for url in agent_urls:
        args += ["--agents", url]
    return Daemon(args, tmp / f"supervisor-{port}.log", f"http://127.0.0.1:{port}", **daemon_kw)


def end_launcher(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End a torchrun (or `rankguard up`) started in its own session, and its workers.
    torchrun starts each worker in a session of its own, so its process group alone
    misses them: SIGTERM first (torchrun then stops its workers), and SIGKILL to every
    process of the tree still there after `grace` seconds, by PID."""
    import psutil

    if proc.poll() is not None:
        return
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for child in tree:  # the PIDs seen under it, checked to be the same processes
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def rendezvous_store(tmp: Path, job: str):
    """`rankguard rendezvous` on a free loopback port, the store `rankguard up` keeps for
    torchrun's `--rdzv-backend rankguard`: yields torchrun's rendezvous flags for `job`
    (the state signed with a new secret in tmp/rendezvous.key)."""
    from .rendezvous import reachable, torchrun_args

    port = free_port()
    secret = tmp / "rendezvous.key"
    new_secret_file(secret)
    with open(tmp / "rendezvous.log", "w") as out:
        proc = subprocess.Popen([*RANKGUARD, "rendezvous", "--port", str(port), "--bind", "127.0.0.1"],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until(lambda: proc.poll() is None and reachable("127.0.0.1", port), 60,
                   f"the rendezvous store ({tmp / 'rendezvous.log'})")  # fmt: skip
        yield torchrun_args(f"127.0.0.1:{port}", job, secret)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class TelemetrySink:
    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.records: list[TelemetryRecord] = []
        self.errors: list[TelemetryError] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            try:
                self.records.append(decode(data))
            except TelemetryError as exc:
                self.errors.append(exc)

    def train_records(self, rank: int) -> list[TelemetryRecord]:
        """Per-step records (those with timings) of one rank."""
        return [r for r in list(self.records) if r.rank == rank and r.step_seconds > 0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def __enter__(self) -> TelemetrySink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def holder_up(path: Path | str) -> bool:
    """A snapshot holder answers `status` on its socket."""
    from ..contract.snapshots import request

    try:
        request(str(path), {"op": "status"}, timeout=1)
        return True
    except (OSError, EOFError):
        return False


class SnapshotHolders:
    """Holder A replicating to holder B (`rankguard snapshot-holder` processes), as two
    nodes' holders would on one machine. `args` are the trainer's flags for them."""

    def __init__(self, tmp: Path, every: int):
        import time

        a, b = tmp / "holder-a.sock", tmp / "holder-b.sock"
        self.procs: list[subprocess.Popen] = []
        try:
            for path, peer in ((b, []), (a, ["--peer", str(b)])):
                self.procs.append(subprocess.Popen(
                    [*RANKGUARD, "snapshot-holder", "run", "--socket", str(path), *peer],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
                deadline = time.monotonic() + 30
                while not holder_up(path):
                    if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                        raise RuntimeError(f"snapshot holder {path} did not start")
                    time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        self.args = ["--snapshot-every", str(every), "--snapshot-holder", str(a),
                     "--snapshot-peers", str(b)]  # fmt: skip

    def cpu_seconds(self) -> float:
        """CPU time (user + system) both holders have used so far."""
        import psutil

        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(p.pid).cpu_times()
                total += t.user + t.system
        return total

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
            p.wait()

    def __enter__(self) -> SnapshotHolders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
