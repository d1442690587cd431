"""A real etcd cluster for the tests: N members of Debian's etcd-server on one host (an
address of the root namespace, reachable from the netns nodes too), each its own process
and data folder, killed and restarted by pid."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from rankguard.cli.local_stack import free_ports

ETCD = shutil.which("etcd")
SKIP_REASON = "needs etcd (Debian's etcd-server; scripts/test installs it as root)"


class EtcdCluster:
    def __init__(self, tmp: Path, n: int = 3, host: str = "127.0.0.1") -> None:
        self.tmp, self.host, self.n = tmp, host, n
        ports = free_ports(2 * n)
        self.client_ports, self.peer_ports = ports[:n], ports[n:]
        self.procs: list[subprocess.Popen | None] = [None] * n
        token = f"rankguard-test-{os.getpid()}-{time.monotonic_ns()}"
        self.initial = ",".join(f"m{i}=http://{host}:{p}" for i, p in enumerate(self.peer_ports))
        self.token = token
        try:
            for i in range(n):
                self.start(i, new=True)
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        return "etcd://" + ",".join(f"{self.host}:{p}" for p in self.client_ports)

    def url(self, i: int) -> str:
        return f"http://{self.host}:{self.client_ports[i]}"

    def start(self, i: int, new: bool = False) -> None:
        """Start member `i` (again: with its data, as a member that rejoins)."""
        peer = f"http://{self.host}:{self.peer_ports[i]}"
        with open(self.tmp / f"etcd-m{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [ETCD, "--name", f"m{i}", "--data-dir", str(self.tmp / f"etcd-m{i}"),
                 "--listen-client-urls", self.url(i), "--advertise-client-urls", self.url(i),
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", self.initial, "--initial-cluster-token", self.token,
                 "--initial-cluster-state", "new" if new else "existing",
                 "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only etcd is in it
            proc.wait(timeout=10)
        self.procs[i] = None

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(self.url(i) + "/health", timeout=1) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members: list[int] | None = None, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        for i in members if members is not None else range(self.n):
            while not self.healthy(i):
                if time.monotonic() > deadline:
                    logs = (self.tmp / f"etcd-m{i}.log").read_text(errors="replace")[-2000:]
                    raise AssertionError(f"etcd member m{i} not healthy: {logs}")
                time.sleep(0.1)

    def close(self) -> None:
        for i in range(self.n):
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                self.kill(i)
