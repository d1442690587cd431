"""The agent's control actions on ranks (agent/control.py): what a kill reaches."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from test_discovery import _found

from rankguard.agent.control import descendants, send_signal
from rankguard.agent.ranks import RankTable

# A rank with a DataLoader-like worker blocked in a read (it never notices its parent's
# death), which has a child of its own.
PARENT = """
import subprocess, sys, time
inner = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", inner])
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_sigkill_of_a_rank_ends_what_it_started_and_other_signals_do_not():
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        deadline = time.monotonic() + 30
        while len(tree := descendants(proc.pid)) < 2:
            assert time.monotonic() < deadline, tree
            time.sleep(0.05)
        with RankTable() as table:
            table.adopt(_found(proc))
            send_signal(table, {"job": "job", "rank": 1, "signal": "SIGCONT"})
            assert all(_alive(p) for p in tree)
            out = send_signal(table, {"job": "job", "rank": 1, "signal": "SIGKILL"})
            assert sorted(out["descendants"]) == sorted(tree)
            proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while any(_alive(p) for p in tree):
                assert time.monotonic() < deadline, [p for p in tree if _alive(p)]
                time.sleep(0.05)
    finally:
        for pid in descendants(proc.pid):  # a failed check leaves them: end them by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
