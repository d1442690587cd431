"""Process identity on this node: what /proc says a process is, read one way.

The rank table (ranks.py) and the control actions (control.py) both need to know a
process by more than its pid: its start time (a recycled pid is another process), its
parent, its uid, whether it is a torchrun launcher or a warm-start stand-in, and what it
started. Every stat read goes through one parser of `/proc/<pid>/stat`
(`parse_proc_stat`); `read_proc_stat`, `process_uid` and `descendants` take the `/proc`
root to read from (tests hand in a fake one)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import NamedTuple

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class RankLookupError(LookupError):
    """No live, verified process behind a (job, rank): control actions must not proceed."""


# Processes control refused to treat as a rank's stand-in or launcher, by reason (a
# bounded label set; exported on /metrics as rankguard_control_refused_total{reason}):
#   foreign_stand_in  a process the rank holds a pidfd on that runs as another uid
#   stale_launcher    a remembered launcher whose pid now has another start time, another
#                     uid, or is no torchrun: never signalled
REFUSED: dict[str, int] = {"foreign_stand_in": 0, "stale_launcher": 0}


class ProcStat(NamedTuple):
    state: str  # the one-letter kernel state
    ppid: int
    cpu_seconds: float  # user + system
    start_ticks: int  # clock ticks after boot at which the process started
    exit_code: int | None = None  # field 52 (waitpid status; meaningful for a zombie)


def parse_proc_stat(text: str) -> ProcStat:
    """Parse a ``/proc/<pid>/stat`` line (ValueError if it is not one).

    The command name (field 2) may hold spaces and parentheses, so split after the
    last ``)``.
    """
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    # fields[0] is field 3 (state); field n of proc(5) is fields[n - 3].
    cpu_ticks = int(fields[11]) + int(fields[12])  # utime + stime
    exit_code = int(fields[49]) if len(fields) >= 50 else None
    return ProcStat(fields[0], int(fields[1]), cpu_ticks / CLOCK_TICKS, int(fields[19]), exit_code)


def read_proc_stat(pid: int, proc_root: Path = Path("/proc")) -> ProcStat | None:
    """The process's stat, or None if there is no such process (any more)."""
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return parse_proc_stat(text)


def descendants(pid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """The processes `pid` started, and theirs, from one scan of /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = read_proc_stat(int(entry.name), proc_root)
        except (OSError, ValueError):
            continue  # not ours to read
        if stat is not None:  # else gone meanwhile
            children.setdefault(stat.ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def is_launcher(pid: int) -> bool:
    """Whether `pid`'s command line is a torchrun / torch.distributed.run elastic agent.

    Never how a launcher is found (that is the rank's real parent, by pid and start time,
    see `launcher_identity`): only a guard, so that stop-job does not SIGTERM the shell or
    test runner a rank was started from directly."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"torch.distributed.run" in cmdline or b"torchrun" in cmdline


def process_uid(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The real uid of a process (/proc/<pid>/status), None if it is gone or unreadable."""
    try:
        text = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            parts = line.split()
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return None


def launcher_identity(pid: int | None) -> tuple[int, int] | None:
    """(pid, start ticks) of a launcher, or None if it is gone: what stop-job checks
    before signalling, so that a recycled pid is never signalled."""
    if pid is None or pid <= 1:
        return None
    try:
        stat = read_proc_stat(pid)
    except (OSError, ValueError):
        return None
    return (pid, stat.start_ticks) if stat is not None else None


def launcher_pid(pid: int, ppid: int | None) -> int | None:
    """The launcher of a rank process: its real parent; or, for a warm-started worker
    (trainer/warm.py, forked by the warm server), the parent of the shim torchrun started,
    which the worker watches through a pidfd. The shim must run as the worker's uid:
    anyone may open a pidfd on any process, and a foreign one must not become this
    rank's stand-in or lead to its launcher."""
    shim = stand_in_pid(pid, ppid)
    stat = read_proc_stat(shim) if shim is not None else None
    return stat.ppid if stat is not None else ppid


def stand_in_pid(pid: int, ppid: int | None) -> int | None:
    """The process torchrun started in place of a rank that runs elsewhere: the warm-start
    shim, a process the rank holds a pidfd on, of the same uid, whose parent is a launcher
    (agent/stand_ins.py). None for a rank that torchrun started itself."""
    if ppid is None or is_launcher(ppid):
        return None
    uid = process_uid(pid)
    for shim in pidfd_targets(pid):
        stat = read_proc_stat(shim)
        if stat is None or not is_launcher(stat.ppid):
            continue
        if uid is not None and process_uid(shim) == uid and process_uid(stat.ppid) == uid:
            return shim
        REFUSED["foreign_stand_in"] += 1
    return None


def pidfd_targets(pid: int) -> list[int]:
    """Processes `pid` holds pidfds of (the kernel names them in fdinfo's `Pid:` line)."""
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[pidfd]":
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key == "Pid" and value.strip().isdigit():
                out.append(int(value))
    return out


def signal_exact(pid: int, start: int, sig: int) -> bool:
    """Signal `pid` only if it is still the process that started at `start`: through a
    pidfd opened first and checked after, so the pid cannot be recycled in between."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return False
    try:
        stat = read_proc_stat(pid)
        if stat is None or stat.start_ticks != start:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def still_launcher(pid: int, start: int, uid: int | None) -> bool:
    """`pid` still names the launcher remembered (same start time), runs as the rank
    owner's uid, and is a torchrun (not the shell a rank was started from)."""
    try:
        stat = read_proc_stat(pid)
    except (OSError, ValueError):
        return False
    if stat is None or stat.start_ticks != start or stat.state in "ZXx":
        return False
    return uid is not None and process_uid(pid) == uid and is_launcher(pid)
