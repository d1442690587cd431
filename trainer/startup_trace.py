"""Startup milestones of one worker: the recovery benchmark and the incident timeline
(`supervisor/restart_phases.py`) split a restart into phases with them.

With `RANKGUARD_STARTUP_TRACE=FILE` each worker appends one JSON line per milestone
(process start, imports done, process group ready, model built, checkpoint loaded, first
step), so a restart's cost can be split into its parts. Without it nothing is written.
"""

from __future__ import annotations

import json
import os
import time

ENV = "RANKGUARD_STARTUP_TRACE"


def process_start_time() -> float:
    """Wall-clock time this process was exec'd, to ~10 ms (the clock tick). Uptime minus
    the process's start tick: /proc/stat's boot time is whole seconds, too coarse."""
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupTrace:
    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else os.environ.get(ENV)
        self.rank = int(os.environ.get("RANK", "0"))
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # set once the group agreed on them: the supervisor matches lines to an incident
        # by (job, incarnation), and a worker's earlier lines by its pid
        self.job: str | None = None
        self.incarnation: int | None = None
        if self.path:
            self.mark("process_start", process_start_time())

    def mark(self, event: str, at: float | None = None) -> None:
        if not self.path:
            return
        line = {"rank": self.rank, "restart": self.restart, "pid": os.getpid(), "event": event,
                "time": time.time() if at is None else at}  # fmt: skip
        if self.incarnation is not None:
            line.update(job=self.job, incarnation=self.incarnation)
        try:
            with open(self.path, "a") as f:  # one short O_APPEND write per line
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass  # a benchmark aid must never stop training
