"""Storage collector: block devices, the filesystems of watched directories (checkpoint,
data), and the I/O of the training ranks themselves.

/metrics carries counters only (Prometheus computes rates); the facts carry rates over
the interval since the previous collection, for /v1/node and the health verdict.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import procfs
from . import (
    RANK_LABELS,
    Collector,
    CollectorContext,
    CollectorResult,
    counter,
    gauge,
    info,
    register,
)

# Virtual block devices whose traffic is either memory or counted again underneath.
SKIPPED_DEVICE_PREFIXES = ("loop", "ram", "zram")

# A statvfs on a dead NFS/Lustre server can block forever; give up after this long and
# leave that path alone until the stuck call returns (node_exporter's "stuck mounts").
STATVFS_TIMEOUT_S = 2.0
# Filesystems with no server behind them: their statvfs cannot block, so it is called
# directly instead of on a thread with a timeout (a thread a role a second was a third of
# the collectors' CPU, bench/agent_overhead.py). Anything else, or an unknown mount, keeps
# the guarded call.
LOCAL_FSTYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "vfat", "zfs",
                           "tmpfs", "ramfs", "overlay"})  # fmt: skip

# DiskStats field -> help; the metric is rankguard_disk_<field>_total.
DISK_COUNTERS = (
    ("read_bytes", "Bytes read from the device."),
    ("written_bytes", "Bytes written to the device."),
    ("reads_completed", "Reads completed."),
    ("writes_completed", "Writes completed."),
)

# PidIO field -> metric stem (rankguard_rank_<stem>_total, also the facts key) and help.
RANK_COUNTERS = (
    (
        "rchar",
        "read_bytes",
        "Bytes the rank got from read() calls: page cache and network filesystems included.",
    ),
    (
        "wchar",
        "written_bytes",
        "Bytes the rank passed to write() calls: page cache and network filesystems included.",
    ),
    ("read_bytes", "storage_read_bytes", "Bytes the block layer read for the rank."),
    ("write_bytes", "storage_written_bytes", "Bytes the rank sent to the block layer."),
)


def whole_disks(devices: list[str], sys_block: Path) -> list[str]:
    """Whole disks only: partitions would count the same I/O twice. /sys/block lists
    exactly the whole devices (with '/' in a name written as '!')."""
    names = [d for d in devices if not d.startswith(SKIPPED_DEVICE_PREFIXES)]
    if sys_block.is_dir():
        listed = {p.name.replace("!", "/") for p in sys_block.iterdir()}
        names = [d for d in names if d in listed]
    return sorted(names)


@dataclass(frozen=True)
class StorageConfig:
    """[collectors.storage]"""

    enabled: bool = True
    # a statvfs on a hung network filesystem blocks; give up on it after this long
    statvfs_timeout_seconds: float = STATVFS_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.statvfs_timeout_seconds > 0:
            raise ValueError("statvfs_timeout_seconds must be > 0")


@register
class StorageCollector(Collector):
    name = "storage"
    Config = StorageConfig
    statvfs = staticmethod(os.statvfs)  # replaceable in tests (a hanging filesystem)

    def __init__(self, ctx: CollectorContext, config: StorageConfig | None = None):
        super().__init__(ctx, config)
        self.statvfs_timeout_s = self.config.statvfs_timeout_seconds
        self._prev_disks: tuple[float, dict[str, procfs.DiskStats]] | None = None
        self._prev_ranks: tuple[float, dict[tuple[str, int, int], procfs.PidIO]] | None = None
        self._stuck: dict[str, threading.Thread] = {}  # path -> statvfs call still blocked

    def collect(self) -> CollectorResult:
        now = self.ctx.clock()
        result = CollectorResult()
        self._disks(now, result)
        self._filesystems(result)
        self._ranks(now, result)
        return result

    # -- block devices --------------------------------------------------------------

    def _disks(self, now: float, result: CollectorResult) -> None:
        stats = procfs.read_diskstats(self.ctx.proc_root)
        devices = whole_disks(list(stats), self.ctx.sys_root / "block")
        prev_t, prev = self._prev_disks or (None, {})
        dt = now - prev_t if prev_t is not None else None
        self._prev_disks = (now, {d: stats[d] for d in devices})

        families = {
            field: counter(f"rankguard_disk_{field}_total", help_, ("device",))
            for field, help_ in DISK_COUNTERS
        }
        io_time = counter(
            "rankguard_disk_io_time_seconds_total",
            "Time the device had I/O in flight (its rate() is the busy fraction).",
            ("device",),
        )
        facts: dict[str, Any] = {}
        for dev in devices:
            cur, old = stats[dev], prev.get(dev)
            io_time.add((dev,), cur.io_time_ms / 1000)
            facts[dev] = {}
            for field, family in families.items():
                family.add((dev,), getattr(cur, field))
                facts[dev][f"{field}_per_second"] = _rate(old, cur, field, dt)
            busy_ms = _rate(old, cur, "io_time_ms", dt)
            facts[dev]["io_utilization_ratio"] = (
                None if busy_ms is None else min(1.0, busy_ms / 1000)
            )
        result.metrics += [*families.values(), io_time]
        result.facts["disks"] = facts
        result.facts["interval_seconds"] = dt

    # -- watched filesystems --------------------------------------------------------

    def _filesystems(self, result: CollectorResult) -> None:
        free = gauge(
            "rankguard_filesystem_free_bytes",
            "Space available to unprivileged users on the filesystem of a watched directory.",
            ("role",),
        )
        size = gauge("rankguard_filesystem_size_bytes", "Filesystem size.", ("role",))
        ratio = gauge(
            "rankguard_filesystem_free_ratio",
            "Free (unprivileged) fraction of the filesystem.",
            ("role",),
        )
        fs_info = info(
            "rankguard_filesystem_info",
            "The watched directory of each role and the mount it lives on.",
            ("role", "path", "mountpoint", "fstype"),
        )
        try:
            mounts = procfs.read_mounts(self.ctx.proc_root)
        except (OSError, procfs.ProcParseError):
            mounts = []  # sizes still work; only mountpoint/fstype are lost
        facts: dict[str, Any] = {}
        for role, path in sorted(self.ctx.watch_dirs.items()):
            real = os.path.realpath(path)
            mount = procfs.find_mount(mounts, real)
            try:
                st = self._statvfs(real, local=mount is not None and mount.fstype in LOCAL_FSTYPES)
            except OSError as exc:
                # one missing or broken directory never hides the other roles
                facts[role] = {"path": str(path), "error": f"{type(exc).__name__}: {exc}"}
                continue
            total, avail = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            frac = avail / total if total else 0.0
            try:  # who may write into it (a checkpoint root others write to is a warning)
                mode: int | None = stat.S_IMODE(os.stat(real).st_mode)
            except OSError:
                mode = None
            mountpoint, fstype = (mount.mountpoint, mount.fstype) if mount else ("", "")
            free.add((role,), avail)
            size.add((role,), total)
            ratio.add((role,), frac)
            fs_info.add((role, str(path), mountpoint, fstype))
            facts[role] = {
                "path": str(path),
                "mountpoint": mountpoint,
                "fstype": fstype,
                "free_bytes": avail,
                "size_bytes": total,
                "free_ratio": frac,
                "mode": mode,
            }
        result.metrics += [free, size, ratio, fs_info]
        result.facts["filesystems"] = facts

    def _statvfs(self, path: str, local: bool = False) -> os.statvfs_result:
        if local:
            return self.statvfs(path)
        stuck = self._stuck.get(path)
        if stuck is not None:
            if stuck.is_alive():
                raise TimeoutError(f"statvfs({path}) is still blocked (stale mount?)")
            del self._stuck[path]
        out: list[Any] = []

        def call() -> None:
            try:
                out.append(self.statvfs(path))
            except OSError as exc:
                out.append(exc)

        worker = threading.Thread(target=call, name=f"statvfs {path}", daemon=True)
        worker.start()
        worker.join(self.statvfs_timeout_s)
        if worker.is_alive():
            self._stuck[path] = worker
            raise TimeoutError(f"statvfs({path}) blocked for over {self.statvfs_timeout_s}s")
        if isinstance(out[0], OSError):
            raise out[0]
        return out[0]

    # -- the ranks' own I/O ---------------------------------------------------------

    def _ranks(self, now: float, result: CollectorResult) -> None:
        families = {
            field: counter(f"rankguard_rank_{stem}_total", help_, RANK_LABELS)
            for field, stem, help_ in RANK_COUNTERS
        }
        prev_t, prev = self._prev_ranks or (None, {})
        dt = now - prev_t if prev_t is not None else None
        current: dict[tuple[str, int, int], procfs.PidIO] = {}
        ranks: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        for job, rank, pid in self.ctx.rank_processes():
            if any(r["job"] == job and r["rank"] == rank for r in ranks):
                # two pids for one rank (a restart in flight) would duplicate a series
                skipped.append({"job": job, "rank": rank, "pid": pid, "reason": "duplicate rank"})
                continue
            try:
                io = procfs.read_pid_io(self.ctx.proc_root, pid)
            except (ProcessLookupError, PermissionError, procfs.ProcParseError) as exc:
                # the rank table lags the processes: a gone pid is normal, never a failure
                skipped.append({"job": job, "rank": rank, "pid": pid, "reason": str(exc)})
                continue
            # keyed by pid too: a restarted rank starts a new baseline
            current[(job, rank, pid)] = io
            old = prev.get((job, rank, pid))
            entry: dict[str, Any] = {"job": job, "rank": rank, "pid": pid}
            for field, stem, _ in RANK_COUNTERS:
                families[field].add((job, str(rank)), getattr(io, field))
                entry[stem] = getattr(io, field)
                entry[f"{stem}_per_second"] = _rate(old, io, field, dt)
            ranks.append(entry)
        self._prev_ranks = (now, current)
        result.metrics += list(families.values())
        result.facts["ranks"] = ranks
        result.facts["ranks_skipped"] = skipped


def _rate(old: Any, cur: Any, field: str, dt: float | None) -> float | None:
    return procfs.per_second(getattr(old, field) if old else None, getattr(cur, field), dt)
