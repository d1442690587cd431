"""The agent's view of the training ranks on its node.

:class:`RankTable` keeps, per ``(job, rank)``, the newest telemetry record, a bounded
history and the state of the process behind it. :class:`ProcessWatcher` learns of a
process's exit the moment it happens (pidfd + epoll), not at the next refresh: DESIGN.md
wants a dead rank known at once. :meth:`RankTable.refresh` reads ``/proc`` for the
slower facts (stopped, zombie, CPU time) and forgets long-dead ranks.

Process identity. A PID alone is not a process: after an exit the kernel may hand the
number to an unrelated program. On first sight of a PID the table records the
process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot: exact and,
unlike psutil's ``create_time()``, which adds a wall-clock boot time, unmoved by clock
steps), and :meth:`RankTable.verified_pid` refuses a PID whose start time changed. Only
PIDs the kernel vouched for (``SCM_CREDENTIALS``, see ``receiver.py``) enter the table.

Process states and what they mean are the contract's (``contract/states.py``): ``alive``,
``stopped``, ``zombie``, ``exited``, ``finished``. A zombie is dead (``up`` false); a
finished rank ended well and is not dead, but it is gone like a dead one
(:data:`ENDED_STATES`: ``exited_at`` stamped, evictable, forgotten later).

A record from a new PID for a known ``(job, rank)`` (torchrun restarted the worker)
replaces the watched process; the history is kept, each entry carrying its pid and
restart count.

Evidence. A record with ``progress`` false (the Reporter's flight-recorder wavefront while
the rank stalls, client/reporter.py) is not progress: it leaves the heartbeat, the history,
the counters and the step as they were and only sets the rank's ``collectives`` and when
they came (``collectives_age_seconds`` in ``/v1/ranks``). Evidence from a torchrun worker
found in /proc (a zero-code script's collective watch, ``client/collective_watch.py``) is
matched by the sender's pid, whatever job and rank it names, and the rank stays a process
rank.

Time. Every ``now`` argument and every stored time is on the table's ``clock``:
``time.time`` by default, so callers pass ``now=time.time()`` and timestamps in the
snapshot are Unix times. (An injected monotonic clock works too: the snapshot then
converts its times to Unix times.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..contract.answers import (
    MainThreadAnswer,
    RankAnswer,
    RankGpuAnswer,
    RanksAnswer,
    Sample,
    TelemetryStats,
)
from ..contract.cursor import Since, answer_fields, new_incarnation, since
from ..contract.states import ENDED_STATES, LIVE_STATES, RANK_STATES
from ..contract.telemetry import NO_STEP, SPLIT_FIELDS, Collective, TelemetryRecord
from ..contract.telemetry import SCHEMA_VERSION as TELEMETRY_VERSION
from .processes import (
    ProcStat,
    RankLookupError,
    launcher_identity,
    launcher_pid,
    parse_proc_stat,
    process_uid,
    read_proc_stat,
    stand_in_pid,
)
from .procfs import ThreadState, read_thread
from .rank_counters import RankCounters
from .stand_ins import StandIn, stand_in_state

__all__ = [
    "HistoryEntry",
    "ProcStat",
    "ProcessWatcher",
    "RankEvent",
    "ForeignOwnerError",
    "RankLookupError",
    "RankQuotaError",
    "RankTable",
    "RankTableFullError",
    "parse_proc_stat",
    "pidfd_supported",
    "read_proc_stat",
]

log = logging.getLogger("rankguard.agent.ranks")

# A process using at least this share of a core over a CPU window is making progress
# (cpu_active_at); a rank asleep in a collective stays far below it.
ACTIVE_CPU_CORES = 0.05

# /proc/<pid>/stat state letter -> (our state, detail). Anything else is "alive".
_LETTER_STATES: dict[str, tuple[str, str | None]] = {
    "D": ("alive", "disk-sleep: uninterruptible wait, usually I/O"),
    "T": ("stopped", "stopped by a signal (SIGSTOP/SIGTSTP)"),
    "t": ("stopped", "tracing-stop: held by a debugger or tracer"),
    "Z": ("zombie", None),
    "X": ("exited", None),
    "x": ("exited", None),
}


class RankTableFullError(RuntimeError):
    """The table holds max_ranks ranks and none of them is dead: a new rank is refused."""


class ForeignOwnerError(RuntimeError):
    """A record for a (job, rank) owned by another uid or another launcher: refused."""


class RankQuotaError(RankTableFullError):
    """The sender's uid already holds its share of the table: a new rank is refused."""


# --------------------------------------------------------------------------- /proc


def describe_exit(status: int) -> str:
    """A waitpid status in words: "exit code 1", "killed by SIGKILL"."""
    import signal

    if status & 0x7F == 0:
        return f"exit code {(status >> 8) & 0xFF}"
    try:
        name = signal.Signals(status & 0x7F).name
    except ValueError:
        name = f"signal {status & 0x7F}"
    return f"killed by {name}"


def _zombie_detail(stat: ProcStat) -> str:
    return f"terminated; not yet reaped by its parent (pid {stat.ppid})"


def pidfd_supported() -> bool:
    """Whether ``os.pidfd_open`` works here (Linux 5.3+, not blocked by seccomp)."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------- watcher


class ProcessWatcher:
    """Calls ``on_exit(pid, when)`` as soon as a watched process terminates.

    Termination means "became a zombie or is gone"; ``when`` is ``clock()`` at that
    moment; the callback runs on the watcher's thread, once per watched PID, and its
    exceptions are logged. With pidfds the kernel wakes one epoll wait the instant a
    process exits; a pidfd also keeps naming the process it was opened for even if the
    PID number is reused. Without ``pidfd_open`` (old kernel, seccomp) the watcher reads
    ``/proc`` every ``poll_interval`` seconds instead. ``use_pidfd``: None picks pidfd
    when available, False forces polling.
    """

    def __init__(
        self,
        on_exit: Callable[[int, float], None],
        *,
        clock: Callable[[], float] = time.time,
        use_pidfd: bool | None = None,
        poll_interval: float = 0.05,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self._on_exit = on_exit
        self._clock = clock
        self.poll_interval = poll_interval
        self._proc_root = proc_root
        want_pidfd = use_pidfd is not False
        self.mode = "pidfd" if want_pidfd and pidfd_supported() else "poll"
        if use_pidfd and self.mode != "pidfd":
            raise OSError("pidfd_open is not available on this system")
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # pidfd -> pid (pidfd mode)
        self._pids: dict[int, int | None] = {}  # pid -> pidfd, or start ticks (poll mode)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        if self.mode == "pidfd":
            self._epoll = select.epoll()
            self._epoll.register(self._wake_r, select.EPOLLIN)
            target = self._run_pidfd
        else:
            target = self._run_poll
        self._thread = threading.Thread(target=target, name="rankguard-watcher", daemon=True)
        self._thread.start()

    def watch(self, pid: int, start_ticks: int | None = None) -> bool:
        """Start watching ``pid``; False if it is already gone (or the watcher is closed).

        ``start_ticks`` (poll mode) lets the poller notice a reused PID.
        """
        with self._lock:
            if self._stop.is_set():
                return False
            if pid in self._pids:
                return True
            if self.mode == "poll":
                self._pids[pid] = start_ticks
                return True
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            self._pids[pid] = fd
            self._fds[fd] = pid
            self._epoll.register(fd, select.EPOLLIN)
            return True

    def unwatch(self, pid: int) -> None:
        with self._lock:
            handle = self._pids.pop(pid, None)
            if self.mode == "pidfd" and handle is not None:
                self._drop_fd(handle)

    def watching(self) -> set[int]:
        with self._lock:
            return set(self._pids)

    def _drop_fd(self, fd: int) -> None:
        self._fds.pop(fd, None)
        self._epoll.unregister(fd)
        os.close(fd)

    def _notify(self, pid: int) -> None:
        try:
            self._on_exit(pid, self._clock())
        except Exception:  # the watcher thread must outlive any callback bug
            log.exception("process exit callback failed for pid %d", pid)

    def _run_pidfd(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._epoll.poll()
            except OSError as e:
                if self._stop.is_set():
                    return
                log.warning("epoll wait failed: %s", e)
                time.sleep(self.poll_interval)
                continue
            for fd, _mask in events:
                if fd == self._wake_r:
                    return
                pid = self._take_exited(fd)
                if pid is not None:
                    self._notify(pid)

    def _take_exited(self, fd: int) -> int | None:
        """Stop watching the process behind a ready pidfd; None for a stale event."""
        with self._lock:
            pid = self._fds.get(fd)
            # An fd number closed by unwatch() may already name a newer pidfd: only
            # a pidfd that is readable right now belongs to a terminated process.
            if pid is None or not _readable(fd):
                return None
            del self._pids[pid]
            self._drop_fd(fd)
            return pid

    def _run_poll(self) -> None:
        while not self._stop.wait(self.poll_interval):
            with self._lock:
                watched = list(self._pids.items())
            for pid, start in watched:
                if self._poll_exited(pid, start):
                    with self._lock:
                        if self._pids.pop(pid, _MISSING) is _MISSING:
                            continue  # unwatched meanwhile
                    self._notify(pid)

    def _poll_exited(self, pid: int, start: int | None) -> bool:
        try:
            stat = read_proc_stat(pid, self._proc_root)
        except (OSError, ValueError) as e:
            log.warning("cannot read /proc/%d/stat: %s", pid, e)
            return False
        if stat is None or stat.state in "ZXx":
            return True
        return start is not None and stat.start_ticks != start

    def close(self) -> None:
        """Stop the thread and release every pidfd. Idempotent."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        with self._lock:
            if self.mode == "pidfd":
                for fd in list(self._fds):
                    self._drop_fd(fd)
                self._epoll.close()
            self._pids.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)


_MISSING = object()


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


# --------------------------------------------------------------------------- table


@dataclass(frozen=True)
class RankEvent:
    """A change of a rank's process state, as passed to ``subscribe`` callbacks.

    ``previous`` is None on first sight of the rank; ``at`` is on the table's clock.
    A new process for a known rank (restart) is an event ``previous -> "alive"``.
    """

    job: str
    rank: int
    pid: int
    previous: str | None
    state: str
    at: float
    detail: str | None = None
    restart: int | None = None  # the incarnation its records named (state changes only)
    step: int | None = None  # its last step reported (telemetry ranks, state changes only)
    checkpoint_step: int | None = None  # its newest validated checkpoint reported (the same)


def _process_record(job: str, w: Any) -> TelemetryRecord:
    """The identity fields of a worker found in /proc, in the shape the table keeps."""
    return TelemetryRecord(
        v=TELEMETRY_VERSION, job=job, rank=w.rank, local_rank=w.local_rank,
        world_size=w.world_size, pid=w.pid, restart=w.restart, phase="init", time=time.time(),
        **NO_STEP,
    )  # fmt: skip


class HistoryEntry(NamedTuple):
    """One received record, kept compact: a full record object is several times larger."""

    received_at: float  # table clock (Unix time by default)
    pid: int  # with restart: marks which process incarnation sent it
    restart: int
    step: int
    phase: str
    step_seconds: float
    data_wait_seconds: float
    compute_seconds: float
    comm_seconds: float
    loss: float | None
    seq: int = 0  # the table's sample number, for incremental reads (contract/cursor.py)
    compute_wait_seconds: float | None = None  # run-queue wait in compute; None: unknown

    @classmethod
    def of(cls, record: TelemetryRecord, now: float, seq: int = 0) -> HistoryEntry:
        r = record
        return cls(
            now, r.pid, r.restart, r.step, r.phase, r.step_seconds,
            r.data_wait_seconds, r.compute_seconds, r.comm_seconds, r.loss, seq,
            r.compute_wait_seconds,
        )  # fmt: skip

    def sample(self, with_seq: bool = False) -> Sample:
        """One sample of ``recent``; ``seq`` only in incremental answers (the legacy
        answer stays as it was)."""
        return Sample(
            self.step, self.phase, self.restart, self.pid, self.step_seconds,
            self.data_wait_seconds, self.compute_seconds, self.comm_seconds, self.loss,
            self.seq if with_seq else None, self.compute_wait_seconds,
        )  # fmt: skip


class _Activity:
    """CPU time measured over windows of at least `window` seconds (so that an extra
    /v1/ranks refresh does not measure over a few milliseconds): the last window's rate, in
    cores, and when a window last reached ACTIVE_CPU_CORES."""

    def __init__(self, now: float, seconds: float | None):
        self.base = (now, seconds) if seconds is not None else None
        self.rate: float | None = None
        self.active_at = now

    def account(self, seconds: float, now: float, window: float) -> None:
        if self.base is None:
            self.base = (now, seconds)
            return
        t0, c0 = self.base
        if now - t0 >= window:
            self.rate = max(0.0, (seconds - c0) / (now - t0))
            self.base = (now, seconds)
            if self.rate >= ACTIVE_CPU_CORES:
                self.active_at = now


class _Rank:
    """One rank's state. Every method runs under the table's lock."""

    def __init__(
        self,
        record: TelemetryRecord,
        stat: ProcStat | None,
        now: float,
        history: int,
        source: str = "telemetry",
    ):
        self.job, self.rank = record.job, record.rank
        # "telemetry": registered by its own records; "process": a torchrun worker found
        # in /proc (agent/discovery.py) that sends none: no steps, no heartbeat
        self.source = source
        self.record = record
        self.step_record: TelemetryRecord | None = None  # newest record with step timings
        self.first_seen = self.last_seen = now
        self.records_received = 0
        self.process_changes = 0
        self.counters = RankCounters()  # for rates: steps, tokens, step time, FLOPs
        self.nvml_gpu: tuple[int, str] | None = None  # (pid, UUID) NVML last listed it on
        self.history: deque[HistoryEntry] = deque(maxlen=history)
        self.start_process(record.pid, stat, now)
        # Ownership (docs/security.md): the kernel-verified uid and the launcher (pid,
        # start ticks) of the first registration speak for this (job, rank) until that
        # launcher exits; set by the table.
        self.owner_uid: int | None = None
        self.owner_launcher: tuple[int, int] | None = self.launcher

    def start_process(self, pid: int, stat: ProcStat | None, now: float) -> None:
        """Watch a new process from now on (first sight, or a restart)."""
        self.pid = pid
        self.start_ticks = stat.start_ticks if stat else None
        # torchrun's agent, for stop-job: remembered now, as between incarnations every
        # rank is dead and the job must still be stoppable
        self.parent_pid = launcher_pid(pid, stat.ppid) if stat else None
        # ... and its identity: a pid alone could be recycled by the time it is signalled
        self.launcher = launcher_identity(self.parent_pid)
        self.stand_in = _find_stand_in(pid, stat, now)  # a warm-start shim: watched too
        self.state, self.detail = "alive", None
        self.state_since = now  # when the state last changed (a stop's duration)
        self.exit_code: int | None = None  # waitpid status, when read from the zombie
        self.exited_at: float | None = None
        self.cpu_seconds = stat.cpu_seconds if stat else None
        # CPU use is measured from here (first sight), then refresh to refresh
        self.cpu = _Activity(now, self.cpu_seconds)
        # the main thread's own (tid == pid): its state letter is the process's stat's
        self.main: tuple[str, ThreadState] | None = None
        self.main_cpu = _Activity(now, None)
        # the wavefront of this process's newest evidence record, and when it came: a new
        # process starts without one (its predecessor's says nothing about it)
        self.collectives: tuple[Collective, ...] = ()
        self.collectives_at: float | None = None
        # a zero-code worker's optimizer step, from its watch's beacons (None: not known)
        self.script_step: int | None = None

    def note_collectives(self, record: TelemetryRecord, now: float) -> None:
        """Keep a record's wavefront; an evidence record (``progress`` false) that names
        none says the recorder shows nothing."""
        self.collectives = record.collectives or ()
        self.collectives_at = now

    def observe(self, record: TelemetryRecord, now: float, seq: int = 0) -> None:
        self.record = record
        # Heartbeats (phase changes) carry no timings: keep the last step's split.
        if record.step_seconds > 0:
            self.step_record = record
        self.last_seen = now
        self.records_received += 1
        self.counters.observe(record)
        self.history.append(HistoryEntry.of(record, now, seq))

    def dead_state(self, zombie: bool) -> str:
        if self.source == "process":
            # no "done" record: a worker that exited 0 finished; the status is read from
            # the zombie (torchrun reaps it at its next poll, the pidfd wakes us first)
            if self.exit_code == 0:
                return "finished"
        elif self.record.phase == "done":
            return "finished"
        return "zombie" if zombie else "exited"

    def note_exit(self, stat: ProcStat | None) -> None:
        """Remember the exit status of this rank's zombie process, if it is one."""
        if (
            stat is not None
            and stat.state == "Z"
            and stat.start_ticks == self.start_ticks
            and stat.exit_code is not None
        ):
            self.exit_code = stat.exit_code

    def change(self, state: str, detail: str | None, now: float) -> RankEvent | None:
        """Set the state; an event only when the state itself changed (not the detail)."""
        previous = self.state
        self.state, self.detail = state, detail
        if state in ENDED_STATES and self.exited_at is None:
            self.exited_at = now
        if state == previous:
            return None
        self.state_since = now
        # the last step and checkpoint ride along: a supervisor applying a death to an older
        # view of the node would otherwise count the steps lost from a stale step, and give
        # the crash-loop guard a stale checkpoint (supervisor/events.py)
        rec = self.record if self.source == "telemetry" else None
        return RankEvent(
            self.job, self.rank, self.pid, previous, state, now, detail, self.record.restart,
            step=rec.step if rec else None, checkpoint_step=rec.checkpoint_step if rec else None,
        )  # fmt: skip

    def apply_stat(
        self,
        stat: ProcStat | None,
        now: float,
        cpu_window: float,
        main: ThreadState | None = None,
    ) -> RankEvent | None:
        """Fold a fresh /proc reading into the state (refresh); `main`: the main thread's."""
        if stat is None or (self.start_ticks is not None and stat.start_ticks != self.start_ticks):
            return self.change(self.dead_state(False), None, now)  # reaped, or PID reused
        state, detail = _LETTER_STATES.get(stat.state, ("alive", None))
        if state in ENDED_STATES:
            zombie = state == "zombie"
            self.note_exit(stat)
            return self.change(
                self.dead_state(zombie), _zombie_detail(stat) if zombie else None, now
            )
        self.cpu_seconds = stat.cpu_seconds
        self.cpu.account(stat.cpu_seconds, now, cpu_window)
        self.main = (stat.state, main) if main is not None else None
        if main is not None:
            self.main_cpu.account(main.run_seconds, now, cpu_window)
        return self.change(state, detail, now)

    def answer(
        self,
        now: float,
        to_unix: float,
        recent: int,
        after: int | None = None,
        gpu: RankGpuAnswer | None = None,
    ) -> RankAnswer:
        """The rank as ``/v1/ranks`` shows it. ``after``: an incremental answer, whose
        ``recent`` holds only the samples numbered above it, and ``recent_from`` the number
        of the oldest sample in the whole window (a client drops what it holds below that:
        samples that left the window)."""
        rec, st = self.record, self.step_record
        telemetry = self.source == "telemetry"  # a found process has no steps to tell
        window = self._window(recent)
        if after is None:
            samples, first = tuple(e.sample() for e in window), None
        else:
            samples = tuple(e.sample(True) for e in window if e.seq > after)
            first = window[0].seq if window else None
        return RankAnswer(
            job=self.job,
            rank=self.rank,
            local_rank=rec.local_rank,
            world_size=rec.world_size,
            pid=self.pid,
            restart=rec.restart,
            state=self.state,
            source=self.source,
            process_changes=self.process_changes,
            state_detail=self.detail,
            state_since=self.state_since + to_unix,
            exit_code=self.exit_code,
            exited_at=None if self.exited_at is None else self.exited_at + to_unix,
            first_seen_at=self.first_seen + to_unix,
            step=rec.step if telemetry else None,
            phase=rec.phase if telemetry else None,
            heartbeat_age_seconds=max(0.0, now - self.last_seen) if telemetry else None,
            last_heartbeat_at=self.last_seen + to_unix if telemetry else None,
            timed_step=st.step if st else None,
            step_seconds=st.step_seconds if st else None,
            **{name: getattr(st, name) if st else None for name in SPLIT_FIELDS},
            comm_compute_ratio=st.comm_compute_ratio if st else None,
            tokens_per_second=st.tokens_per_second if st else None,
            mfu=st.mfu if st else None,
            loss=rec.loss if telemetry else None,
            peak_memory_bytes=rec.peak_memory_bytes if telemetry else None,
            checkpoint_step=rec.checkpoint_step if telemetry else None,
            cpu_seconds=self.cpu_seconds,
            cpu_utilization=self.cpu.rate,
            cpu_active_at=self.cpu.active_at + to_unix,
            records_received=self.records_received,
            client_errors=dict(rec.client_errors or {}),
            resume_skips=(rec.resume_skips or ()) if telemetry else (),
            recent=samples,
            recent_from=first,
            stand_in=self.stand_in.answer(to_unix) if self.stand_in else None,
            gpu=gpu,
            main_thread=self._main_answer(to_unix),
            collectives=self.collectives,
            script_step=None if telemetry else self.script_step,
            collectives_age_seconds=None
            if self.collectives_at is None
            else max(0.0, now - self.collectives_at),
        )

    def _main_answer(self, to_unix: float) -> MainThreadAnswer | None:
        if self.main is None or self.state not in LIVE_STATES:
            return None
        letter, t = self.main
        return MainThreadAnswer(
            letter, t.run_seconds, self.main_cpu.active_at + to_unix, self.main_cpu.rate,
            t.wchan, t.syscall,
        )  # fmt: skip

    def _window(self, n: int) -> list[HistoryEntry]:
        """The last n step records (heartbeats without timings left out), oldest first."""
        picked: list[HistoryEntry] = []
        for entry in reversed(self.history):
            if len(picked) >= n:
                break
            if entry.step_seconds > 0:
                picked.append(entry)
        picked.reverse()
        return picked


def _launcher_words(launcher: tuple[int, int] | None) -> str:
    return f"launcher {launcher[0]}" if launcher else "a process without a launcher"


def _find_stand_in(pid: int, stat: ProcStat | None, now: float) -> StandIn | None:
    shim = stand_in_pid(pid, stat.ppid) if stat else None
    shim_stat = read_proc_stat(shim) if shim is not None else None
    if shim_stat is None:
        return None
    return StandIn(
        shim, shim_stat.start_ticks, stand_in_state(shim_stat, shim_stat.start_ticks), now
    )


class RankTable:
    """Thread-safe table of the training ranks on this node, keyed by (job, rank).

    Fed by the telemetry receiver (:meth:`update`), kept current by a
    :class:`ProcessWatcher` (exits, at once) and :meth:`refresh` (stops, zombies, CPU;
    forgetting), read by the collector and ``/v1/ranks`` (:meth:`snapshot`) and by
    control actions (:meth:`verified_pid`). One lock guards all state; subscriber
    callbacks run outside it.

    ``max_ranks`` bounds the table (and the metrics' label sets): a new rank beyond it
    takes the place of the longest-dead rank, or is refused (:class:`RankTableFullError`,
    counted) when every rank is live. Dead ranks are forgotten ``forget_after`` seconds
    after their exit.

    Ownership and quotas (docs/security.md): a (job, rank) belongs to the uid and the
    launcher of its first registration while that launcher lives
    (:class:`ForeignOwnerError` otherwise); one uid holds at most ``max_ranks_per_uid``
    entries (:class:`RankQuotaError`), except the ``privileged_uids`` (root and the
    agent's own uid by default), which may fill the table: one user inventing (job,
    rank) keys cannot push out another user's ranks.
    """

    def __init__(
        self,
        *,
        max_ranks: int = 1024,
        history: int = 512,
        recent: int = 64,
        forget_after: float = 3600.0,
        cpu_window: float = 1.0,
        clock: Callable[[], float] = time.time,
        wall_clock: Callable[[], float] = time.time,
        proc_root: Path = Path("/proc"),
        use_pidfd: bool | None = None,
        max_ranks_per_uid: int = 256,
        privileged_uids: frozenset[int] | None = None,
    ) -> None:
        if max_ranks < 1 or history < 1 or recent < 0 or forget_after < 0:
            raise ValueError("max_ranks and history must be >= 1; recent, forget_after >= 0")
        if max_ranks_per_uid < 1:
            raise ValueError("max_ranks_per_uid must be >= 1")
        self.max_ranks = max_ranks
        self.max_ranks_per_uid = max_ranks_per_uid
        self.privileged_uids = (
            frozenset({0, os.getuid()}) if privileged_uids is None else privileged_uids
        )
        self.foreign = 0  # records refused: the (job, rank) belongs to another owner
        self.over_quota = 0  # new ranks refused: the uid holds its share of the table
        self.history = history
        self.recent = recent
        self.forget_after = forget_after
        self.cpu_window = cpu_window
        self._clock = clock
        self._wall = wall_clock
        self._proc_root = proc_root
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], _Rank] = {}
        self._subscribers: list[Callable[[RankEvent], None]] = []
        self._offset = wall_clock() - clock()
        self.refused = 0  # new ranks refused because the table was full of live ones
        self.evicted = 0  # dead ranks dropped early to make room
        self.forgotten = 0  # dead ranks dropped after forget_after
        self.incarnation = new_incarnation()  # names this table in cursors (contract/cursor.py)
        self._seq = 0  # the newest sample number handed out
        # Set by the telemetry receiver: judges the datagrams waiting on its socket. Called
        # before an exit is applied, as the receiver lets records gather (receiver.py).
        self.flush_telemetry: Callable[[], object] | None = None
        # From the GPU collector's last reading: each GPU's faults by UUID (note_gpus).
        self._gpu_faults: dict[str, dict[str, Any]] = {}
        self._watcher = ProcessWatcher(
            self._on_exit, clock=clock, use_pidfd=use_pidfd, proc_root=proc_root
        )

    @property
    def watcher_mode(self) -> str:
        return self._watcher.mode

    # -- feeding ----------------------------------------------------------------------
    def update(
        self,
        record: TelemetryRecord,
        sender_pid: int,
        now: float | None = None,
        *,
        uid: int | None = None,
        age: float = 0.0,
    ) -> None:
        """Take one record whose sender the kernel identified as ``sender_pid`` and
        ``uid`` (None: the agent's own uid, for in-process callers), received ``age``
        seconds before ``now`` (it waited in the socket's queue for a batched drain).

        Raises ValueError if the record's pid is not the sender's,
        :class:`ForeignOwnerError` for a (job, rank) someone else owns, and
        :class:`RankTableFullError` (or its :class:`RankQuotaError`) for a new rank that
        does not fit.
        """
        if record.pid != sender_pid:
            raise ValueError(f"record pid {record.pid} is not the sender's pid {sender_pid}")
        uid = os.getuid() if uid is None else uid
        now = self._now(now) - age
        key = (record.job, record.rank)
        with self._lock:
            if not record.progress and (found := self._worker_of(sender_pid)) is not None:
                # a zero-code worker's wavefront or step beacon (client/collective_watch.py):
                # evidence for the rank found in /proc, which stays a process rank
                if record.collectives is not None:
                    found.note_collectives(record, now)
                if record.step > 0:
                    found.script_step = record.step
                return
            rank = self._ranks.get(key)
            if rank is None and not record.progress and record.collectives is None:
                return  # a step beacon from a worker not found in /proc (yet): nothing to note
            if rank is None:
                stat = self._stat(sender_pid)
                self._check_job_owner(key, uid, self._launcher_of(sender_pid, stat))
                self._check_uid_quota(key, uid)
                self._make_room(key)
                rank = _Rank(record, self._identify(sender_pid), now, self.history)
                rank.owner_uid = uid
                self._ranks[key] = rank
                events = [RankEvent(rank.job, rank.rank, sender_pid, None, "alive", now)]
            elif rank.pid == sender_pid and self._same_process(rank):
                if rank.owner_uid is not None and uid != rank.owner_uid:
                    self._refuse_foreign(rank, f"uid {uid}")  # the process changed uid
                events = []
            else:
                events = [self._take_over(rank, sender_pid, uid, now)]
            # A worker found in /proc that now speaks telemetry is that same rank, and from
            # now on a telemetry rank (its steps, phase and heartbeat are known).
            rank.source = "telemetry"
            # Evidence (progress false: a stalled rank's wavefront) is no sign of progress:
            # the heartbeat, history, counters and step stay as they were, or a hung rank
            # would look alive. A process seen for the first time registers with it as
            # with any record.
            if record.progress or events:
                self._seq += 1
                rank.observe(record, now, self._seq)
            if record.collectives is not None or not record.progress:
                rank.note_collectives(record, now)
            events.append(self._settle(rank, now))
            self._drop_discovered(rank)
        self._emit(events)

    def _worker_of(self, pid: int) -> _Rank | None:
        """The live rank found in /proc (source "process") that ``pid`` still is."""
        return next(
            (
                r
                for r in self._ranks.values()
                if r.source == "process" and r.pid == pid and r.state in LIVE_STATES
            ),
            None,
        )

    def _take_over(self, rank: _Rank, pid: int, uid: int, now: float) -> RankEvent:
        """A new process speaks for a known rank: a restart by the rank's owner (same uid,
        same launcher), or anyone's once the owner's launcher has exited."""
        launcher = self._launcher_of(pid, self._stat(pid))
        if self._owner_holds(rank):
            if uid != rank.owner_uid:
                self._refuse_foreign(rank, f"uid {uid}")
            # The owner's own next run from another launcher (a script rerun from another
            # shell) may follow once the rank's process has ended; two of its launchers
            # may not fight over a live rank. A sender already gone (its late record) has
            # no launcher to compare: its uid is the owner's, which is what matters.
            if launcher not in (None, rank.owner_launcher) and rank.state in LIVE_STATES:
                self._refuse_foreign(rank, _launcher_words(launcher))
        else:
            self._check_job_owner((rank.job, rank.rank), uid, launcher)
        event = self._replace_process(rank, pid, now)
        rank.owner_uid, rank.owner_launcher = uid, rank.launcher
        return event

    def _stat(self, pid: int) -> ProcStat | None:
        try:
            return read_proc_stat(pid, self._proc_root)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _launcher_of(pid: int, stat: ProcStat | None) -> tuple[int, int] | None:
        return launcher_identity(launcher_pid(pid, stat.ppid)) if stat else None

    def _check_job_owner(
        self, key: tuple[str, int], uid: int, launcher: tuple[int, int] | None
    ) -> None:
        """A new rank of a job joins its owner: the job's other ranks whose owner still
        holds them must have this uid and launcher (else one user could add a rank to
        another's job and have its crash loop stop that job)."""
        for other in self._ranks.values():
            if other.job != key[0] or other.rank == key[1] or not self._owner_holds(other):
                continue
            if uid != other.owner_uid:
                self._refuse_foreign(other, f"uid {uid} for rank {key[1]}")
            if launcher not in (None, other.owner_launcher) and other.state in LIVE_STATES:
                self._refuse_foreign(other, f"{_launcher_words(launcher)} for rank {key[1]}")

    def _owner_holds(self, rank: _Rank) -> bool:
        """Whether the rank's owner still speaks for it: its launcher lives (same pid and
        start time), or, for a rank without a known launcher, its process does."""
        if rank.owner_uid is None:
            return False
        if rank.owner_launcher is None:
            return rank.state in LIVE_STATES
        pid, start = rank.owner_launcher
        stat = read_proc_stat(pid, self._proc_root)
        return stat is not None and stat.start_ticks == start and stat.state not in "ZXx"

    def _refuse_foreign(self, rank: _Rank, who: str) -> None:
        self.foreign += 1
        owner = f"launcher {rank.owner_launcher[0]}" if rank.owner_launcher else "its process"
        raise ForeignOwnerError(
            f"job {rank.job!r} rank {rank.rank} belongs to uid {rank.owner_uid} and {owner} "
            f"until that exits; refusing {who}"
        )

    def _check_uid_quota(self, key: tuple[str, int], uid: int) -> None:
        """Room for one more rank of ``uid``: its longest-ended rank makes room, if any."""
        if uid in self.privileged_uids:
            return
        mine = [(r.exited_at, k) for k, r in self._ranks.items() if r.owner_uid == uid]
        if len(mine) < self.max_ranks_per_uid:
            return
        ended = [(at, k) for at, k in mine if at is not None]
        if ended:
            del self._ranks[min(ended)[1]]
            self.evicted += 1
            return
        self.over_quota += 1
        raise RankQuotaError(
            f"uid {uid} holds {len(mine)} live ranks (its quota): refusing job {key[0]!r} "
            f"rank {key[1]}"
        )

    def _drop_discovered(self, rank: _Rank) -> None:
        """A process that speaks telemetry is one rank, not two: forget the ranks found in
        /proc for the same process, or for the same torchrun launcher (its workers speak
        telemetry: their telemetry ranks are the job's ranks)."""
        for key, other in list(self._ranks.items()):
            if other.source != "process" or other is rank:
                continue
            if other.pid == rank.pid or (
                rank.parent_pid is not None and other.parent_pid == rank.parent_pid
            ):
                del self._ranks[key]
                if not any(r.pid == other.pid for r in self._ranks.values()):
                    self._watcher.unwatch(other.pid)

    def adopt(self, found: list[tuple[str, Any]], now: float | None = None) -> int:
        """Take torchrun workers found in /proc that send no telemetry (agent/discovery.py):
        ``[(job, Worker)]``. A worker becomes a rank with ``source`` "process"; a new
        process for a known (job, rank) is a restart. Workers whose pid or launcher already
        has a telemetry rank are left out, and a full table refuses new ones (counted).
        Returns how many ranks were added or restarted."""
        now = self._now(now)
        events: list[RankEvent | None] = []
        with self._lock:
            telemetry_pids = {r.pid for r in self._ranks.values() if r.source == "telemetry"}
            telemetry_launchers = {
                r.parent_pid for r in self._ranks.values() if r.source == "telemetry"
            }
            for job, w in found:
                if w.pid in telemetry_pids or w.launcher in telemetry_launchers:
                    continue
                key = (job, w.rank)
                rank = self._ranks.get(key)
                if rank is not None and rank.source != "process":
                    continue  # a telemetry rank holds that name
                if rank is not None and rank.pid == w.pid:
                    continue  # already watched
                try:
                    record = _process_record(job, w)
                except ValueError:  # a run id that is no job name (non-printable)
                    continue
                stat = self._identify_worker(w)
                if stat is None:
                    continue  # gone already, or its pid was reused
                if rank is None:
                    try:
                        self._make_room(key)
                    except RankTableFullError:
                        self._watcher.unwatch(w.pid)
                        continue
                    rank = _Rank(record, stat, now, self.history, source="process")
                    rank.parent_pid = w.launcher
                    rank.launcher = rank.owner_launcher = (w.launcher, w.launcher_start)
                    rank.owner_uid = process_uid(w.pid, self._proc_root)
                    self._ranks[key] = rank
                    events.append(RankEvent(job, w.rank, w.pid, None, "alive", now))
                else:
                    old_pid, previous = rank.pid, rank.state
                    if not any(r.pid == old_pid for r in self._ranks.values() if r is not rank):
                        self._watcher.unwatch(old_pid)
                    rank.record = record
                    rank.start_process(w.pid, stat, now)
                    rank.parent_pid = w.launcher
                    rank.launcher = rank.owner_launcher = (w.launcher, w.launcher_start)
                    rank.owner_uid = process_uid(w.pid, self._proc_root)
                    rank.process_changes += 1
                    detail = f"new process {w.pid} replaces {old_pid}"
                    events.append(RankEvent(job, w.rank, w.pid, previous, "alive", now, detail))
        self._emit(events)
        return len(events)

    def _identify_worker(self, w: Any) -> ProcStat | None:
        stat = read_proc_stat(w.pid, self._proc_root)
        if stat is None or stat.start_ticks != w.start_ticks or stat.state in "ZXx":
            return None
        if not self._watcher.watch(w.pid, stat.start_ticks):
            return None
        return stat

    def known_pids(self, source: str = "telemetry") -> set[int]:
        """Pids of the ranks registered by ``source`` (live or not)."""
        with self._lock:
            return {r.pid for r in self._ranks.values() if r.source == source}

    def telemetry_launchers(self) -> set[int]:
        """Launchers whose workers speak telemetry: discovery leaves their workers alone."""
        with self._lock:
            return {
                r.parent_pid
                for r in self._ranks.values()
                if r.source == "telemetry" and r.parent_pid is not None
            }

    def _identify(self, pid: int) -> ProcStat | None:
        """Identity of a process seen for the first time, now watched; None if gone."""
        stat = read_proc_stat(pid, self._proc_root)
        if stat is None or not self._watcher.watch(pid, stat.start_ticks):
            return None
        return stat

    def _same_process(self, rank: _Rank) -> bool:
        """Whether rank.pid still names the process the rank was registered with.

        A live rank: yes (the watcher would have said otherwise). A dead one: a late
        record from it (sent just before exiting, read after the watcher's news), unless
        the PID now belongs to a newer process.
        """
        if rank.state in LIVE_STATES:
            return True
        stat = read_proc_stat(rank.pid, self._proc_root)
        return stat is None or stat.start_ticks == rank.start_ticks

    def _replace_process(self, rank: _Rank, pid: int, now: float) -> RankEvent:
        """A new process for a known rank: torchrun restarted it. History is kept."""
        old_pid, previous = rank.pid, rank.state
        if not any(r.pid == old_pid for r in self._ranks.values() if r is not rank):
            self._watcher.unwatch(old_pid)
        rank.start_process(pid, self._identify(pid), now)
        rank.process_changes += 1
        detail = f"new process {pid} replaces {old_pid}"
        return RankEvent(rank.job, rank.rank, pid, previous, "alive", now, detail)

    def _settle(self, rank: _Rank, now: float) -> RankEvent | None:
        """Dead-state bookkeeping after a record: a process already gone when first seen
        is dead at once; a late "done" record turns "exited" into "finished"."""
        if rank.state in LIVE_STATES and rank.start_ticks is None:
            return rank.change(rank.dead_state(False), "exited before it was watched", now)
        if rank.state in ENDED_STATES:
            return rank.change(rank.dead_state(rank.state == "zombie"), rank.detail, now)
        return None

    def _make_room(self, key: tuple[str, int]) -> None:
        if len(self._ranks) < self.max_ranks:
            return
        dead = [(r.exited_at or 0.0, k) for k, r in self._ranks.items() if r.state in ENDED_STATES]
        if dead:
            del self._ranks[min(dead)[1]]
            self.evicted += 1
            return
        self.refused += 1
        raise RankTableFullError(
            f"rank table full ({self.max_ranks} live ranks): refusing job {key[0]!r} rank {key[1]}"
        )

    def _on_exit(self, pid: int, when: float) -> None:
        """ProcessWatcher callback: every live rank of this process is now dead."""
        flush = self.flush_telemetry
        if flush is not None:
            # What the process sent before it exited is queued now: count it first, so a
            # final "done" record makes the rank finished, never exited in between.
            try:
                flush()
            except Exception:
                log.exception("draining telemetry before an exit failed")
        try:
            stat = read_proc_stat(pid, self._proc_root)
        except (OSError, ValueError):
            stat = None
        events = []
        with self._lock:
            for rank in self._ranks.values():
                if rank.pid != pid or rank.state not in LIVE_STATES:
                    continue
                zombie = (
                    stat is not None and stat.state == "Z" and stat.start_ticks == rank.start_ticks
                )
                rank.note_exit(stat)
                detail = _zombie_detail(stat) if zombie and stat else None
                if rank.source == "process" and rank.exit_code is not None:
                    detail = describe_exit(rank.exit_code)
                events.append(rank.change(rank.dead_state(zombie), detail, when))
        self._emit(events)

    # -- keeping current ----------------------------------------------------------------
    def refresh(self, now: float | None = None) -> None:
        """Read /proc for every live or zombie rank (state, CPU); forget long-dead ranks."""
        now = self._now(now)
        with self._lock:
            self._forget(now)
            targets = [
                (key, r.pid)
                for key, r in self._ranks.items()
                if r.state in LIVE_STATES or r.state == "zombie"
            ]
            # stand-ins outlive their rank when stopped: watched while they exist
            shims = [(r.stand_in, r.stand_in.pid) for r in self._ranks.values()
                     if r.stand_in is not None and r.stand_in.watched]  # fmt: skip
        stats: dict[tuple[str, int], ProcStat | None] = {}
        mains: dict[tuple[str, int], ThreadState] = {}
        for key, pid in targets:  # /proc reads outside the lock
            try:
                stats[key] = read_proc_stat(pid, self._proc_root)
            except (OSError, ValueError) as e:
                log.warning("cannot read /proc/%d/stat: %s", pid, e)
                continue
            if stats[key] is not None and stats[key].state not in "ZXx":
                # gone meanwhile, or no schedstat in this kernel: none this time
                with contextlib.suppress(OSError, ValueError):
                    mains[key] = read_thread(self._proc_root, pid, pid)
        shim_stats = {}
        for _, pid in shims:
            try:
                shim_stats[pid] = read_proc_stat(pid, self._proc_root)
            except (OSError, ValueError) as e:
                log.warning("cannot read /proc/%d/stat: %s", pid, e)
        events = []
        with self._lock:
            for key, pid in targets:
                rank = self._ranks.get(key)
                if rank is None or rank.pid != pid or key not in stats:
                    continue  # forgotten or restarted meanwhile, or unreadable
                events.append(rank.apply_stat(stats[key], now, self.cpu_window, mains.get(key)))
            for shim, pid in shims:
                if pid in shim_stats:
                    shim.observe(shim_stats[pid], now)
        self._emit(events)

    def _forget(self, now: float) -> None:
        for key, rank in list(self._ranks.items()):
            if rank.exited_at is not None and now - rank.exited_at > self.forget_after:
                del self._ranks[key]
                self.forgotten += 1

    # -- listeners ----------------------------------------------------------------------
    def subscribe(self, callback: Callable[[RankEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on every rank state change; returns an unsubscribe.

        Callbacks run outside the lock, on whichever thread saw the change (the
        watcher's for exits, the refresher's for stops, the receiver's for new ranks);
        their exceptions are logged and never propagate.
        """
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _emit(self, events: list[RankEvent | None]) -> None:
        events = [e for e in events if e is not None]
        if not events:
            return
        with self._lock:
            callbacks = list(self._subscribers)
        for event in events:
            for callback in callbacks:
                try:
                    callback(event)
                except Exception:
                    log.exception("rank event subscriber failed on %s", event)

    # -- reading ------------------------------------------------------------------------
    def snapshot(
        self, now: float | None = None, *, recent: int | None = None
    ) -> list[dict[str, Any]]:
        """Per-rank state as ``/v1/ranks`` shows it (JSON), sorted by (job, rank).

        ``recent``: how many step records to summarise (default: the table's ``recent``).
        """
        return [a.to_json() for a in self.answers(now, recent=recent)]

    def answers(self, now: float | None = None, *, recent: int | None = None) -> list[RankAnswer]:
        """Per-rank state, sorted by (job, rank): the collector's input."""
        now = self._now(now)
        n = self.recent if recent is None else recent
        with self._lock:
            return self._answers(now, n, None)

    def read(
        self,
        after: str | None,
        now: float | None = None,
        *,
        node: str = "",
        telemetry: TelemetryStats | None = None,
    ) -> RanksAnswer:
        """``/v1/ranks`` for a client's ``after`` (contract/cursor.py): every rank, and for
        an ``after`` the cursor fields. Raises CursorError."""
        now = self._now(now)
        with self._lock:  # the cursor and the samples from one moment
            s = since(after, self.incarnation, self._seq)
            ranks = tuple(self._answers(now, self.recent, s))
            cursor = {} if s is None else answer_fields(s, self.incarnation, self._seq)
            at = now + self._unix_offset()
        return RanksAnswer(node=node, time=at, ranks=ranks,
                           telemetry=telemetry or TelemetryStats(), **cursor)  # fmt: skip

    def _answers(self, now: float, n: int, s: Since | None) -> list[RankAnswer]:
        to_unix = self._unix_offset()
        after = None if s is None else s.seq
        return [
            self._ranks[key].answer(now, to_unix, n, after, self._gpu(self._ranks[key]))
            for key in sorted(self._ranks)
        ]

    def note_gpus(self, pid_gpus: dict[int, str], faults: dict[str, dict[str, Any]]) -> None:
        """The GPU collector's reading: pid -> GPU UUID (NVML's process lists) and each
        GPU's faults by UUID (RankGpuAnswer's fields less uuid and source). A rank keeps
        the GPU NVML last listed its process on: a dead process leaves the list, and its
        death is when its GPU matters most."""
        with self._lock:
            self._gpu_faults = dict(faults)
            for r in self._ranks.values():
                uuid = pid_gpus.get(r.pid)
                if uuid is not None:
                    r.nvml_gpu = (r.pid, uuid)

    def _gpu(self, rank: _Rank) -> RankGpuAnswer | None:
        """The rank's GPU: the one its records name, else the one NVML listed its process
        on (a zero-code rank; needs the host's pid namespace), with that GPU's faults."""
        uuid = rank.record.gpu_uuid if rank.source == "telemetry" else None
        source = "reported"
        if uuid is None and rank.nvml_gpu is not None and rank.nvml_gpu[0] == rank.pid:
            uuid, source = rank.nvml_gpu[1], "nvml"  # this process's, not a predecessor's
        if uuid is None:
            return None
        return RankGpuAnswer(uuid, source, **self._gpu_faults.get(uuid, {}))

    def rank_gpus(self) -> list[tuple[str, int, str]]:
        """(job, rank, GPU UUID) of every live rank whose GPU is known."""
        with self._lock:
            out = []
            for (job, rank), r in sorted(self._ranks.items()):
                gpu = self._gpu(r) if r.state in LIVE_STATES else None
                if gpu is not None:
                    out.append((job, rank, gpu.uuid))
            return out

    def _unix_offset(self) -> float:
        """Table clock -> Unix time. Re-based only when the wall clock was stepped, so a
        rank's timestamps stay the same from one snapshot to the next."""
        offset = self._wall() - self._clock()
        if abs(offset - self._offset) > 1.0:
            self._offset = offset
        return self._offset

    def counters(self) -> list[tuple[str, int, RankCounters]]:
        """(job, rank, a copy of its counters) of every telemetry rank, sorted."""
        with self._lock:
            return [
                (job, rank, r.counters.copy())
                for (job, rank), r in sorted(self._ranks.items())
                if r.source == "telemetry"
            ]

    def processes(self) -> list[tuple[str, int, int]]:
        """(job, rank, pid) of every live (alive or stopped) rank."""
        with self._lock:
            return [
                (r.job, r.rank, r.pid)
                for _, r in sorted(self._ranks.items())
                if r.state in LIVE_STATES
            ]

    def parent_pids(self, job: str) -> set[int]:
        """Parents (at registration) of the job's rank processes, live or dead: the job's
        launchers. A caller must check a pid is still the launcher before signalling it."""
        with self._lock:
            return {r.parent_pid for r in self._ranks.values() if r.job == job and r.parent_pid}

    def launchers(self, job: str) -> dict[tuple[int, int], int | None]:
        """The job's launchers as remembered at its ranks' registration, live or dead:
        (pid, start ticks) -> the owner uid. A caller signals one only while that pid still
        has that start time (agent/control.py: a recycled pid is never signalled)."""
        with self._lock:
            return {
                r.launcher: r.owner_uid
                for r in self._ranks.values()
                if r.job == job and r.launcher is not None
            }

    def counts(self) -> dict[str, int]:
        """Number of ranks in each state, every state present."""
        out = dict.fromkeys(RANK_STATES, 0)
        with self._lock:
            for rank in self._ranks.values():
                out[rank.state] += 1
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            size = len(self._ranks)
        return {
            "ranks": size,
            "max_ranks": self.max_ranks,
            "refused": self.refused,
            "evicted": self.evicted,
            "forgotten": self.forgotten,
            "foreign": self.foreign,
            "over_quota": self.over_quota,
            "watcher": self.watcher_mode,
        }

    def stand_in_pid(self, job: str, rank: int) -> int | None:
        """The pid of a rank's stand-in (a warm-start shim) while it is the process the
        rank was registered with; else None. Checked like `verified_pid`."""
        with self._lock:
            entry = self._ranks.get((job, rank))
            shim = entry.stand_in if entry is not None else None
            if shim is None or not shim.watched:
                return None
            pid, start = shim.pid, shim.start_ticks
        stat = read_proc_stat(pid, self._proc_root)
        return pid if stand_in_state(stat, start) != "gone" else None

    def verified_pid(self, job: str, rank: int) -> int:
        """The PID of a registered, live rank whose process is still the one registered.

        Raises :class:`RankLookupError` otherwise: unknown rank, process dead (or
        zombie), or the PID now names a process with another start time. Control
        actions use this and never an arbitrary PID.
        """
        with self._lock:
            entry = self._ranks.get((job, rank))
            if entry is None:
                raise RankLookupError(f"no rank {rank} of job {job!r} on this node")
            pid, start, state = entry.pid, entry.start_ticks, entry.state
        if state not in LIVE_STATES:
            raise RankLookupError(f"rank {rank} of job {job!r}: process {pid} is {state}")
        stat = read_proc_stat(pid, self._proc_root)
        if stat is None or stat.state in "ZXx":
            raise RankLookupError(f"rank {rank} of job {job!r}: process {pid} is gone")
        if start is None or stat.start_ticks != start:
            raise RankLookupError(
                f"rank {rank} of job {job!r}: pid {pid} now belongs to another process "
                f"(start time changed); refusing"
            )
        return pid

    # -- lifecycle ----------------------------------------------------------------------
    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def close(self) -> None:
        self._watcher.close()

    def __enter__(self) -> RankTable:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
