"""The daemons `rankguard up` keeps running: a dead agent or supervisor is started again with
the same arguments (same port, database and token), as systemd's `Restart=on-failure` does
for the installed units.

`KeptDaemon.tick()` is the whole rule; starting a process and asking its health endpoint
are passed in, so the rule is tested with fakes and a clock. States:

- `up`: running and answered its health check once. Exited: `down`, restarted at once.
- `starting`: spawned, not yet healthy. Healthy: `up`. Exited, or not healthy within
  `start_timeout` (then killed): `down` with a backoff, doubling per failed start.
- `down`: waiting for its next start.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def describe_exit(returncode: int) -> str:
    """`-9` -> "killed by SIGKILL", `1` -> "exited 1" (Popen's returncode convention)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited {returncode}"


@dataclass
class KeptDaemon:
    name: str
    spawn: Callable[[], subprocess.Popen]
    healthy: Callable[[], bool]
    proc: subprocess.Popen  # started and healthy already (`up` waits for the first start)
    clock: Callable[[], float] = time.monotonic
    start_timeout: float = 60.0
    backoff_base: float = 1.0
    backoff_max: float = 30.0
    state: str = "up"
    restarts: int = 0  # starts after a death (attempts, failed ones included)
    last_exit: str | None = None
    _retry_at: float = 0.0
    _started_at: float = 0.0
    _failed_starts: int = field(default=0, repr=False)

    def tick(self) -> str | None:
        """Look once and act; returns a line for the operator when something changed."""
        now = self.clock()
        if self.state == "up":
            code = self.proc.poll()
            if code is None:
                return None
            self.last_exit = describe_exit(code)
            self.state, self._retry_at = "down", now
            return f"{self.name} {self.last_exit}; restarting it"
        if self.state == "down":
            if now < self._retry_at:
                return None
            self.proc = self.spawn()
            self.restarts += 1
            self.state, self._started_at = "starting", now
            return None
        code = self.proc.poll()  # starting
        if code is None and self.healthy():
            self.state, self._failed_starts = "up", 0
            return f"{self.name} restarted ({self.restarts} so far), serving again"
        if code is None and now - self._started_at < self.start_timeout:
            return None
        if code is None:
            self.proc.kill()
            self.proc.wait()
            self.last_exit = f"not healthy within {self.start_timeout:g}s"
        else:
            self.last_exit = describe_exit(code)
        self._failed_starts += 1
        wait = min(self.backoff_base * 2 ** (self._failed_starts - 1), self.backoff_max)
        self.state, self._retry_at = "down", now + wait
        return f"{self.name} failed to start again ({self.last_exit}); next try in {wait:g}s"

    def note(self) -> str:
        """For the status line: nothing while all is well and nothing was restarted."""
        parts = []
        if self.state != "up":
            parts.append(
                f"{self.name} {self.state}" + (f" ({self.last_exit})" if self.last_exit else "")
            )
        if self.restarts:
            parts.append(f"{self.name} restarts {self.restarts}")
        return " | ".join(parts)
