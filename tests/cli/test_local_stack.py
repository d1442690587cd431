"""The local stack's helpers that the benchmarks rely on (cli/local_stack.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
from harness import wait_until

from rankguard.cli.local_stack import end_launcher

# A launcher like torchrun: its worker runs in a session of its own, so the launcher's
# process group does not reach it.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                          start_new_session=True)
print(worker.pid, flush=True)
time.sleep(120)
"""


def test_end_launcher_ends_workers_in_sessions_of_their_own():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)  # fmt: skip
    worker = psutil.Process(int(launcher.stdout.readline()))
    assert os.getsid(worker.pid) != os.getsid(launcher.pid)
    end_launcher(launcher, grace=5)
    assert launcher.returncode is not None
    wait_until(lambda: _ended(worker), 10, "the worker to end")
    end_launcher(launcher)  # already ended: nothing to do


def _ended(p: psutil.Process) -> bool:
    try:  # killed and not yet reaped by its new parent counts as ended
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
