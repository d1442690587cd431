"""Zero-code protection: find torchrun workers that never speak telemetry.

A training script that does not use the telemetry protocol is still a set of processes
torchrun started: children of a ``torch.distributed.run`` launcher whose environment
holds ``RANK``, ``LOCAL_RANK`` and ``TORCHELASTIC_RUN_ID`` (torchrun sets them for every
worker). The agent scans ``/proc`` for such processes and hands them to the rank table,
which watches them by pidfd like any rank: death at once, stopped/zombie and CPU time from
``/proc``. They have no steps, loss or step-time split: those need the library.

Trust. Only kernel facts are used: the parent/child link and start times from
``/proc/<pid>/stat``, the launcher's command line and the worker's initial environment
from ``/proc/<pid>/{cmdline,environ}`` (the kernel shows ``environ`` only to the
process's own user, root or a ptrace-capable reader, and it is what the process was
started with, not what it claims later). A local user can only make their *own*
processes look like workers. Jobs are kept apart by their launcher: the run id belongs
to the first launcher seen with it (``owners``), a second launcher reusing it gets
``<run id>@<launcher pid>``; torchrun's default run id ``none`` is always
``torchrun-<launcher pid>``. Everything is bounded: at most ``MAX_WORKERS`` workers per
scan, at most ``MAX_ENVIRON_BYTES`` read per environ, ``MAX_OWNERS`` remembered run ids.

Parsing and grouping are pure functions (tested on literal data); :class:`WorkerScanner`
does the reading.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ..contract.telemetry import DEFAULT_SOCKET_PATH, SOCKET_ENV

log = logging.getLogger("rankguard.agent.discovery")

__all__ = [
    "MAX_ENVIRON_BYTES",
    "MAX_WORKERS",
    "Worker",
    "WorkerScanner",
    "assign_jobs",
    "is_launcher_cmdline",
    "parse_environ",
    "worker_from_environ",
]

MAX_ENVIRON_BYTES = 256 * 1024
MAX_WORKERS = 1024
MAX_OWNERS = 4096
WANTED = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        SOCKET_ENV,
    }
)
DISCOVER_MODES = ("auto", "all", "off")
MAX_RUN_ID_CHARS = 100  # job names are at most 128: room for '@<launcher pid>'


@dataclass(frozen=True)
class Worker:
    """One torchrun worker process as the kernel shows it."""

    pid: int
    start_ticks: int
    launcher: int  # the torchrun launcher's pid (the worker's parent)
    launcher_start: int  # its start time, so a reused launcher pid is a new launcher
    run_id: str
    rank: int
    local_rank: int
    world_size: int
    restart: int
    socket: str | None = None  # RANKGUARD_TELEMETRY_SOCKET as the worker has it; None: unset


def parse_environ(data: bytes, wanted: Iterable[str] = WANTED) -> dict[str, str]:
    """``/proc/<pid>/environ`` (NUL-separated ``KEY=value``) -> the wanted keys.

    Undecodable bytes are replaced; entries without ``=`` are skipped; the first
    occurrence of a key wins (as getenv does).
    """
    want = frozenset(wanted)
    out: dict[str, str] = {}
    for entry in data[:MAX_ENVIRON_BYTES].split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if not sep:
            continue
        k = key.decode("utf-8", "replace")
        if k in want and k not in out:
            out[k] = value.decode("utf-8", "replace")
    return out


def _int(value: str | None, least: int = 0) -> int | None:
    if value is None or not value.strip().isdigit():
        return None
    n = int(value)
    return n if n >= least else None


def worker_from_environ(
    pid: int, start_ticks: int, launcher: int, launcher_start: int, env: Mapping[str, str]
) -> Worker | None:
    """A :class:`Worker` when ``env`` is a torchrun worker's environment, else None.

    Needs ``TORCHELASTIC_RUN_ID`` (non-empty), ``RANK`` and ``LOCAL_RANK`` (integers);
    ``WORLD_SIZE`` defaults to rank + 1, ``TORCHELASTIC_RESTART_COUNT`` to 0. A rank not
    below the world size is not a worker's.
    """
    run_id = (env.get("TORCHELASTIC_RUN_ID") or "").strip()
    rank, local_rank = _int(env.get("RANK")), _int(env.get("LOCAL_RANK"))
    if not run_id or rank is None or local_rank is None:
        return None
    world = _int(env.get("WORLD_SIZE"), 1)
    world = world if world is not None else rank + 1
    if rank >= world:
        return None
    restart = _int(env.get("TORCHELASTIC_RESTART_COUNT")) or 0
    socket = env.get(SOCKET_ENV)
    if socket is not None and socket.strip().lower() in ("", "off"):
        socket = None  # telemetry off: the worker names no agent
    return Worker(pid, start_ticks, launcher, launcher_start, run_id[:MAX_RUN_ID_CHARS], rank,
                  local_rank, world, restart, socket)  # fmt: skip


def belongs_here(worker_socket: str | None, agent_socket: str, mode: str = "auto") -> bool:
    """Whether this agent watches a worker, by the telemetry socket the worker was started
    with (``RANKGUARD_TELEMETRY_SOCKET``; relative paths resolved already).

    A worker naming an agent's socket belongs to that agent only: several agents may share
    one machine (tests, network namespaces), and each must watch only its own jobs. A
    worker naming none belongs to the node's agent: ``auto`` takes it when this agent
    listens on the default socket (the node's systemd agent), ``all`` always, ``off``
    takes nothing.
    """
    if mode == "off":
        return False
    if worker_socket is None:
        return mode == "all" or os.path.normpath(agent_socket) == DEFAULT_SOCKET_PATH
    return os.path.normpath(worker_socket) == os.path.normpath(agent_socket)


def is_launcher_cmdline(cmdline: bytes) -> bool:
    """Whether a ``/proc/<pid>/cmdline`` is torchrun's (``torchrun`` or
    ``python -m torch.distributed.run``)."""
    args = [a for a in cmdline.split(b"\0") if a]
    if not args:
        return False
    if os.path.basename(args[0]) == b"torchrun":
        return True
    for i, a in enumerate(args[:4]):
        if os.path.basename(a) == b"torchrun" and i <= 1:  # "python /usr/bin/torchrun"
            return True
        if a == b"-m" and i + 1 < len(args) and args[i + 1] == b"torch.distributed.run":
            return True
    return False


def assign_jobs(
    workers: Iterable[Worker], owners: OrderedDict[str, tuple[int, int]]
) -> list[tuple[str, Worker]]:
    """Name each worker's job, keeping jobs apart by launcher.

    ``owners`` maps a run id to the launcher (pid, start ticks) that first used it; it is
    updated here (oldest entries dropped beyond ``MAX_OWNERS``). Torchrun's default run
    id ``none`` names nothing, so such a job is ``torchrun-<launcher pid>``.
    """
    out = []
    for w in sorted(workers, key=lambda w: (w.launcher_start, w.launcher, w.rank, w.pid)):
        launcher = (w.launcher, w.launcher_start)
        if w.run_id == "none":
            out.append((f"torchrun-{w.launcher}", w))
            continue
        owner = owners.get(w.run_id)
        if owner is None:
            owners[w.run_id] = launcher
            while len(owners) > MAX_OWNERS:
                owners.popitem(last=False)
            owner = launcher
        job = w.run_id if owner == launcher else f"{w.run_id}@{w.launcher}"
        out.append((job, w))
    return out


class WorkerScanner:
    """Reads ``/proc`` for torchrun workers: :meth:`scan` -> [(job, Worker)].

    ``skip(pid)`` leaves out processes the rank table already knows by telemetry, and
    ``skip_launcher(pid)`` launchers whose workers speak telemetry.
    """

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        agent_socket: str = DEFAULT_SOCKET_PATH,
        mode: str = "auto",
    ) -> None:
        if mode not in DISCOVER_MODES:
            raise ValueError(f"mode must be one of {', '.join(DISCOVER_MODES)}, not {mode!r}")
        self.proc_root = proc_root
        self.agent_socket = os.path.abspath(agent_socket)
        self.mode = mode
        self.owners: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._launchers: dict[tuple[int, int], bool] = {}  # (pid, start) -> is torchrun
        self._stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, start ticks)
        self.unreadable = 0  # environs the kernel would not show us (another user's)
        self.truncated = 0  # scans that met more than MAX_WORKERS workers

    def _stat(self, pid: int) -> tuple[int, int] | None:
        """(ppid, start ticks) of a process, None when gone or unreadable."""
        from .ranks import parse_proc_stat

        try:
            stat = parse_proc_stat((self.proc_root / str(pid) / "stat").read_text())
        except (OSError, ValueError):
            return None
        if stat.state in "ZXx":
            return None
        return stat.ppid, stat.start_ticks

    def _is_launcher(self, pid: int, start: int) -> bool:
        key = (pid, start)
        known = self._launchers.get(key)
        if known is None:
            try:
                cmdline = (self.proc_root / str(pid) / "cmdline").read_bytes()[:4096]
            except OSError:
                return False
            known = is_launcher_cmdline(cmdline)
            self._launchers[key] = known
        return known

    def scan(
        self,
        skip: Callable[[int], bool] = lambda pid: False,
        skip_launcher: Callable[[int], bool] = lambda pid: False,
    ) -> list[tuple[str, Worker]]:
        try:
            names = os.listdir(self.proc_root)
        except OSError as exc:
            log.warning("cannot list %s: %s", self.proc_root, exc)
            return []
        # (ppid, start) of every process; only new pids are read (a process's parent and
        # start time do not change while it lives, and the launchers' children are read
        # again below), so a scan costs a listdir plus the new processes
        pids = {int(n) for n in names if n.isdigit()}
        stats = {pid: st for pid, st in self._stats.items() if pid in pids}
        for pid in pids - stats.keys():
            st = self._stat(pid)
            if st is not None:
                stats[pid] = st
        self._stats = stats
        # forget launcher verdicts of processes that are gone (bounded by live processes)
        self._launchers = {k: v for k, v in self._launchers.items() if stats.get(k[0], (0, -1))[1] == k[1]}  # fmt: skip
        workers: list[Worker] = []
        for pid, (ppid, start) in sorted(stats.items()):
            parent = stats.get(ppid)
            if parent is None or not self._is_launcher(ppid, parent[1]):
                continue
            fresh = self._stat(pid)  # re-read: the pid may have been reused since cached
            if fresh is None or fresh != (ppid, start):
                self._stats.pop(pid, None)
                continue
            if skip(pid) or skip_launcher(ppid):
                continue
            if len(workers) >= MAX_WORKERS:
                self.truncated += 1
                break
            try:
                data = (self.proc_root / str(pid) / "environ").read_bytes()[:MAX_ENVIRON_BYTES]
            except PermissionError:
                self.unreadable += 1
                continue
            except OSError:
                continue
            w = worker_from_environ(pid, start, ppid, parent[1], parse_environ(data))
            if w is None:
                continue
            if w.socket is not None and not os.path.isabs(w.socket):
                try:  # relative to the worker's working directory
                    cwd = os.readlink(self.proc_root / str(pid) / "cwd")
                except OSError:
                    continue
                w = replace(w, socket=os.path.join(cwd, w.socket))
            if belongs_here(w.socket, self.agent_socket, self.mode):
                workers.append(w)
        return assign_jobs(workers, self.owners)
