"""Parsers for the kernel's /proc and /sys text files, and thin readers around them.

Parsing is kept apart from reading, as node_exporter does: every ``parse_*`` function is
a pure function of a string (tested on literal text copied from real machines), and
every ``read_*`` function only joins an injectable root with a path, reads the file and
hands the text to its parser. Malformed text raises :class:`ProcParseError`, which names
the file and the offending line so an operator can see exactly what the kernel said.

Units follow Prometheus: seconds (CPU ticks divided by USER_HZ, milliseconds by 1000)
and bytes (kB by 1024, 512-byte sectors by 512).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

_Parsed = TypeVar("_Parsed")


def _sysconf(name: str, default: int) -> int:
    try:
        value = os.sysconf(name)
    except (ValueError, OSError):
        return default
    return value if value > 0 else default


# Ticks per second of the times in /proc/stat and /proc/<pid>/stat (almost always 100).
USER_HZ = _sysconf("SC_CLK_TCK", 100)
PAGE_SIZE = _sysconf("SC_PAGE_SIZE", 4096)
SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own size


class ProcParseError(ValueError):
    """A kernel file did not have the shape we expect."""

    def __init__(self, file: str, reason: str, lineno: int | None = None, line: str = ""):
        self.file, self.reason, self.lineno, self.line = file, reason, lineno, line
        where = f"{file}:{lineno}" if lineno is not None else file
        super().__init__(f"{where}: {reason}" + (f" (line: {line!r})" if line else ""))


def _ints(fields: list[str], file: str, lineno: int, line: str) -> list[int]:
    try:
        return [int(f) for f in fields]
    except ValueError:
        raise ProcParseError(file, "expected integers", lineno, line) from None


# --- /proc/stat --------------------------------------------------------------------

CPU_MODES = (
    "user",
    "nice",
    "system",
    "idle",
    "iowait",
    "irq",
    "softirq",
    "steal",
    "guest",
    "guest_nice",
)


@dataclass(frozen=True)
class CpuStat:
    seconds: dict[str, float]  # per mode, summed over all CPUs (aggregate "cpu" line)
    cpus: int  # number of "cpuN" lines: the online CPUs

    @property
    def busy_seconds(self) -> float:
        # guest time is already included in user/nice, so it is not added again
        return sum(
            v for m, v in self.seconds.items() if m not in ("idle", "iowait", "guest", "guest_nice")
        )

    @property
    def total_seconds(self) -> float:
        return sum(v for m, v in self.seconds.items() if m not in ("guest", "guest_nice"))


def parse_stat(text: str, clk_tck: int = USER_HZ, file: str = "/proc/stat") -> CpuStat:
    seconds: dict[str, float] | None = None
    cpus = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            continue
        if fields[0] == "cpu":
            # older kernels have fewer columns; the first four always exist
            if len(fields) < 5:
                raise ProcParseError(file, "cpu line has fewer than 4 counters", lineno, line)
            values = _ints(fields[1 : 1 + len(CPU_MODES)], file, lineno, line)
            modes = CPU_MODES[: len(values)]
            seconds = {mode: v / clk_tck for mode, v in zip(modes, values, strict=True)}
        elif fields[0][3:].isdigit():
            cpus += 1
    if seconds is None:
        raise ProcParseError(file, "no aggregate 'cpu' line")
    return CpuStat(seconds, cpus)


# --- /proc/meminfo -----------------------------------------------------------------


def parse_meminfo(text: str, file: str = "/proc/meminfo") -> dict[str, int]:
    """Every field, in bytes where the kernel says kB (HugePages_* counts stay counts)."""
    out: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not key or len(parts) not in (1, 2) or (len(parts) == 2 and parts[1] != "kB"):
            raise ProcParseError(file, "expected 'Key: value [kB]'", lineno, line)
        (value,) = _ints(parts[:1], file, lineno, line)
        out[key.strip()] = value * 1024 if len(parts) == 2 else value
    if "MemTotal" not in out:
        raise ProcParseError(file, "no MemTotal")
    return out


# --- /proc/loadavg -----------------------------------------------------------------


@dataclass(frozen=True)
class LoadAvg:
    load1: float
    load5: float
    load15: float


def parse_loadavg(text: str, file: str = "/proc/loadavg") -> LoadAvg:
    line = text.strip()
    fields = line.split()
    try:
        if len(fields) >= 3:
            return LoadAvg(float(fields[0]), float(fields[1]), float(fields[2]))
    except ValueError:
        pass
    raise ProcParseError(file, "expected three load averages", 1, line)


# --- /proc/diskstats ---------------------------------------------------------------


@dataclass(frozen=True)
class DiskStats:
    reads_completed: int
    read_bytes: int
    writes_completed: int
    written_bytes: int
    io_time_ms: int  # time the device had I/O in flight (iostat's %util numerator)


def parse_diskstats(text: str, file: str = "/proc/diskstats") -> dict[str, DiskStats]:
    """Per device. Lines have 14 fields, 18 since Linux 4.18 (discards), 20 since 5.5
    (flushes); later kernels may append more, which are ignored."""
    out: dict[str, DiskStats] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 14:
            raise ProcParseError(
                file, f"expected at least 14 fields, got {len(fields)}", lineno, line
            )
        v = _ints(fields[3:14], file, lineno, line)
        # v: reads, reads merged, sectors read, ms reading, writes, writes merged,
        #    sectors written, ms writing, in flight, ms doing I/O, weighted ms
        out[fields[2]] = DiskStats(
            reads_completed=v[0],
            read_bytes=v[2] * SECTOR_BYTES,
            writes_completed=v[4],
            written_bytes=v[6] * SECTOR_BYTES,
            io_time_ms=v[9],
        )
    return out


# --- /proc/net/dev -----------------------------------------------------------------


@dataclass(frozen=True)
class NetDevStats:
    rx_bytes: int
    rx_packets: int
    rx_errs: int
    rx_drop: int
    tx_bytes: int
    tx_packets: int
    tx_errs: int
    tx_drop: int


def parse_net_dev(text: str, file: str = "/proc/net/dev") -> dict[str, NetDevStats]:
    out: dict[str, NetDevStats] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if "|" in line or not line.strip():  # the two header lines
            continue
        # rpartition: counters never contain ':'; old kernels glue "eth0:123" together
        name, sep, rest = line.rpartition(":")
        fields = rest.split()
        if not sep or not name.strip() or len(fields) != 16:
            raise ProcParseError(file, "expected 'iface: 16 counters'", lineno, line)
        v = _ints(fields, file, lineno, line)
        out[name.strip()] = NetDevStats(v[0], v[1], v[2], v[3], v[8], v[9], v[10], v[11])
    return out


# --- /proc/<pid>/io ----------------------------------------------------------------


@dataclass(frozen=True)
class PidIO:
    rchar: int  # bytes passed to read()-like calls: page cache, pipes, network filesystems
    wchar: int
    read_bytes: int  # bytes the block layer fetched for this process
    write_bytes: int  # bytes this process caused to be sent to the block layer


def parse_pid_io(text: str, file: str = "/proc/<pid>/io") -> PidIO:
    values: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, rest = line.partition(":")
        if not sep or len(rest.split()) != 1:
            raise ProcParseError(file, "expected 'key: value'", lineno, line)
        (values[key.strip()],) = _ints(rest.split(), file, lineno, line)
    missing = [k for k in ("rchar", "wchar", "read_bytes", "write_bytes") if k not in values]
    if missing:
        raise ProcParseError(file, f"missing {', '.join(missing)}")
    return PidIO(values["rchar"], values["wchar"], values["read_bytes"], values["write_bytes"])


# --- /proc/<pid>/stat --------------------------------------------------------------


@dataclass(frozen=True)
class PidStat:
    pid: int
    comm: str
    state: str  # R, S, D (uninterruptible: often stuck I/O), Z, T, t, ...
    ppid: int
    utime_seconds: float
    stime_seconds: float
    num_threads: int
    starttime_seconds: float  # since boot
    rss_bytes: int


def parse_pid_stat(
    text: str, clk_tck: int = USER_HZ, page_size: int = PAGE_SIZE, file: str = "/proc/<pid>/stat"
) -> PidStat:
    line = text.strip()
    # comm may contain spaces and ')' itself: it ends at the last ')'
    head, sep, tail = line.rpartition(")")
    pid, lpar, comm = head.partition(" (")
    rest = tail.split()
    if not sep or not lpar or len(rest) < 22 or len(rest[0]) != 1:
        raise ProcParseError(
            file, "expected 'pid (comm) state ...' with at least 24 fields", 1, line
        )
    # rest[i] is field i+3 of proc(5): state=3, ppid=4, utime=14, stime=15,
    # num_threads=20, starttime=22, rss=24 (pages)
    n = _ints([pid, rest[1], rest[11], rest[12], rest[17], rest[19], rest[21]], file, 1, line)
    return PidStat(
        pid=n[0],
        comm=comm,
        state=rest[0],
        ppid=n[1],
        utime_seconds=n[2] / clk_tck,
        stime_seconds=n[3] / clk_tck,
        num_threads=n[4],
        starttime_seconds=n[5] / clk_tck,
        rss_bytes=n[6] * page_size,
    )


# --- /proc/<pid>/task/<tid>/schedstat, wchan, syscall ---------------------------------


@dataclass(frozen=True)
class ThreadState:
    """One thread as the scheduler sees it (its state letter is in its stat file)."""

    run_seconds: float  # time on a CPU so far
    wchan: str | None  # the kernel function it sleeps in; None when it runs (or unknown)
    syscall: str | None  # "running", "-1" (asleep outside a syscall) or the syscall number


def parse_schedstat(text: str, file: str = "/proc/<pid>/schedstat") -> float:
    """A task's time on a CPU in seconds: the first of "run_ns wait_ns timeslices"."""
    fields = text.split()
    if len(fields) != 3:
        raise ProcParseError(file, "expected 'run_ns wait_ns timeslices'", 1, text.strip())
    return _ints(fields, file, 1, text.strip())[0] / 1e9


def parse_wchan(text: str) -> str | None:
    """Where a task sleeps in the kernel; "0" (or nothing) when it runs or is hidden."""
    name = text.strip()
    return None if name in ("", "0") else name


def parse_syscall(text: str, file: str = "/proc/<pid>/syscall") -> str:
    """What a task is doing: "running", "-1" (blocked outside a system call, e.g. in a page
    fault) or the number of the syscall it is blocked in (its arguments and registers
    dropped)."""
    fields = text.split()
    if not fields or not (fields[0] == "running" or fields[0].lstrip("-").isdigit()):
        raise ProcParseError(file, "expected 'running' or a syscall number", 1, text.strip())
    return fields[0]


def read_thread(proc_root: Path, pid: int, tid: int) -> ThreadState:
    """Raises ProcessLookupError for a vanished thread. wchan and syscall are None where
    they cannot be read (/proc/<pid>/syscall needs ptrace access to the process, and some
    kernels have none)."""
    text, file = _read_pid_file(proc_root, pid, f"task/{tid}/schedstat")
    optional: list[str | None] = []
    for name, parse in (("wchan", parse_wchan), ("syscall", parse_syscall)):
        try:
            optional.append(parse(_read_pid_file(proc_root, pid, f"task/{tid}/{name}")[0]))
        except (OSError, ProcParseError):
            optional.append(None)
    return ThreadState(parse_schedstat(text, file), *optional)


# --- /proc/self/mounts -------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    source: str
    mountpoint: str
    fstype: str


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # the kernel writes space, tab, newline and backslash in paths as \040 \011 \012 \134
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str, file: str = "/proc/self/mounts") -> list[Mount]:
    out: list[Mount] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 3:
            raise ProcParseError(file, "expected 'source mountpoint fstype ...'", lineno, line)
        out.append(Mount(_unescape(fields[0]), _unescape(fields[1]), fields[2]))
    return out


def find_mount(mounts: list[Mount], path: str) -> Mount | None:
    """The mount holding `path` (absolute, resolved): the longest mountpoint that is a
    prefix of it; among equal ones the last, since a later mount hides an earlier one."""
    best, best_len = None, -1
    for m in mounts:
        mp = m.mountpoint.rstrip("/")  # "/" becomes "", a prefix of every absolute path
        if (path == mp or path.startswith(mp + "/")) and len(mp) >= best_len:
            best, best_len = m, len(mp)
    return best


# --- /sys/class/infiniband ---------------------------------------------------------


def parse_ib_state(text: str, file: str = "state") -> tuple[int, str]:
    """'4: ACTIVE' -> (4, 'ACTIVE')."""
    line = text.strip()
    num, sep, name = line.partition(":")
    if not sep or not num.strip().isdigit():
        raise ProcParseError(file, "expected 'N: NAME'", 1, line)
    return int(num), name.strip()


_IB_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)b/sec", re.IGNORECASE)
_SI = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_ib_rate(text: str, file: str = "rate") -> float:
    """'200 Gb/sec (4X HDR)' -> bytes per second (2.5e10)."""
    line = text.strip()
    m = _IB_RATE.match(line)
    if not m:
        raise ProcParseError(file, "expected '<number> Gb/sec ...'", 1, line)
    return float(m.group(1)) * _SI[m.group(2).lower()] / 8


def parse_counter(text: str, file: str = "counter") -> int | None:
    """A sysfs counter file: an integer, or None where the driver says 'N/A (no PMA)'."""
    line = text.strip()
    if line.startswith("N/A"):
        return None
    try:
        return int(line)
    except ValueError:
        raise ProcParseError(file, "expected an integer", 1, line) from None


# --- counter arithmetic ------------------------------------------------------------


def per_second(prev: float | None, cur: float, seconds: float | None) -> float | None:
    """Per-second increase of a counter, None without a previous sample. A decrease
    means the counter was reset (device replaced, process restarted), so the new value
    is the increase, as Prometheus's rate() assumes."""
    if prev is None or seconds is None or seconds <= 0:
        return None
    return (cur - prev if cur >= prev else cur) / seconds


# --- readers -----------------------------------------------------------------------


def _read(path: Path, parse: Callable[..., _Parsed]) -> _Parsed:
    """`parse` of the file at `path`; its errors name that path."""
    return parse(path.read_text(), file=str(path))


def read_stat(proc_root: Path) -> CpuStat:
    return _read(proc_root / "stat", parse_stat)


def read_meminfo(proc_root: Path) -> dict[str, int]:
    return _read(proc_root / "meminfo", parse_meminfo)


def read_loadavg(proc_root: Path) -> LoadAvg:
    return _read(proc_root / "loadavg", parse_loadavg)


def read_diskstats(proc_root: Path) -> dict[str, DiskStats]:
    return _read(proc_root / "diskstats", parse_diskstats)


def read_net_dev(proc_root: Path) -> dict[str, NetDevStats]:
    return _read(proc_root / "net" / "dev", parse_net_dev)


def read_mounts(proc_root: Path) -> list[Mount]:
    path = proc_root / "self" / "mounts"
    if not path.exists():
        path = proc_root / "mounts"
    return _read(path, parse_mounts)


def _read_pid_file(proc_root: Path, pid: int | str, name: str) -> tuple[str, str]:
    path = f"{proc_root}/{pid}/{name}"  # a string: a pathlib join per file read cost more
    try:
        with open(path) as f:  # than the read itself, several files per rank each second
            return f.read(), path
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} is gone ({path} does not exist)") from None
    except PermissionError:
        raise PermissionError(
            f"cannot read {path}: permission denied (the agent needs to run as the "
            f"process's user, as root, or with CAP_SYS_PTRACE)"
        ) from None


def read_pid_io(proc_root: Path, pid: int | str) -> PidIO:
    """Raises ProcessLookupError for a vanished pid, PermissionError (with a message
    saying what is needed) for another user's process."""
    text, file = _read_pid_file(proc_root, pid, "io")
    return parse_pid_io(text, file=file)


def read_pid_stat(proc_root: Path, pid: int | str) -> PidStat:
    text, file = _read_pid_file(proc_root, pid, "stat")
    return parse_pid_stat(text, file=file)
