"""Host, storage and network collectors: against this machine's real /proc and /sys, and
against a fixture tree (exact values, rates over two collections with an injected clock)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rankguard.agent import health, procfs
from rankguard.agent.collectors import CollectorContext, CollectorResult, run_collector
from rankguard.agent.collectors.host import HostCollector
from rankguard.agent.collectors.network import NetworkCollector
from rankguard.agent.collectors.storage import StorageCollector

NEVER_A_PID = 4194305  # above the kernel's largest pid_max (2**22)


def metric(result: CollectorResult, name: str):
    (found,) = [m for m in result.metrics if m.name == name]
    return found


def value(result: CollectorResult, name: str, labels: tuple[str, ...] = ()) -> float:
    samples = dict(metric(result, name).samples)
    return samples[tuple(labels)]


# --- fixture tree ------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


STAT = "cpu  {busy} 0 100 {idle} 0 0 0 0 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\ncpu1 1 0 1 1 0 0 0 0 0 0\n"
SELF_STAT = (
    "4000 (rankguard agent) S 1 4000 4000 0 -1 4194304 100 0 0 0 {utime} 50 0 0 20 0 3 0 "
    "167004 3133440 2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n"
)
DISK = "{maj} 0 {dev} {reads} 0 {sectors} 0 {writes} 0 {wsectors} 0 0 {io_ms} 0\n"
NET = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n"
    "    lo: 999 9 0 0 0 0 0 0 999 9 0 0 0 0 0 0\n"
    "  eth0: {rx} 10 1 2 0 0 0 0 {tx} 20 3 4 0 0 0 0\n"
)
PID_IO = "rchar: {r}\nwchar: {w}\nsyscr: 1\nsyscw: 1\nread_bytes: {rb}\nwrite_bytes: {wb}\ncancelled_write_bytes: 0\n"


def make_tree(root: Path, step: int) -> tuple[Path, Path]:
    """proc and sys roots; `step` 0 or 1 advances every counter for rate checks."""
    proc, sys_ = root / "proc", root / "sys"
    write(proc / "stat", STAT.format(busy=1000 + 50 * step, idle=5000 + 250 * step))
    write(proc / "meminfo", "MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 400 kB\n")
    write(proc / "loadavg", "1.50 0.75 0.25 2/300 4000\n")
    write(proc / "self" / "stat", SELF_STAT.format(utime=150 + 100 * step))
    write(proc / "self" / "mounts", f"/dev/vda / ext4 rw 0 0\nsrv:/x {root} nfs4 rw 0 0\n")
    write(
        proc / "diskstats",
        DISK.format(maj=7, dev="loop0", reads=5, sectors=5, writes=5, wsectors=5, io_ms=5)
        + DISK.format(
            maj=254,
            dev="vda",
            reads=100 + 10 * step,
            sectors=2000 + 200 * step,
            writes=50 + 5 * step,
            wsectors=1000 + 400 * step,
            io_ms=3000 + 500 * step,
        )
        + DISK.format(maj=254, dev="vda1", reads=1, sectors=1, writes=1, wsectors=1, io_ms=1)
        + DISK.format(maj=253, dev="zram0", reads=1, sectors=1, writes=1, wsectors=1, io_ms=1),
    )
    write(proc / "net" / "dev", NET.format(rx=10_000 + 4000 * step, tx=500 + 1000 * step))
    write(
        proc / "100" / "io", PID_IO.format(r=1000 + 2000 * step, w=500, rb=0, wb=4096 * (1 + step))
    )
    for dev in ("vda", "zram0", "loop0"):
        (sys_ / "block" / dev).mkdir(parents=True, exist_ok=True)
    ib = sys_ / "class" / "infiniband"
    # mlx5_0 port 1: ACTIVE, 32-bit-era counters/ only
    write(ib / "mlx5_0/ports/1/state", "4: ACTIVE\n")
    write(ib / "mlx5_0/ports/1/rate", "200 Gb/sec (4X HDR)\n")
    write(ib / "mlx5_0/ports/1/counters/port_rcv_data", f"{1000 + 250 * step}\n")
    write(ib / "mlx5_0/ports/1/counters/port_xmit_data", "2000\n")
    # mlx5_1 port 1: DOWN; counters_ext preferred over counters; rate unreadable
    write(ib / "mlx5_1/ports/1/state", "1: DOWN\n")
    write(ib / "mlx5_1/ports/1/rate", "\n")
    write(ib / "mlx5_1/ports/1/counters/port_rcv_data", "7\n")
    write(ib / "mlx5_1/ports/1/counters_ext/port_rcv_data_64", "5000000000\n")
    write(ib / "mlx5_1/ports/1/counters/port_xmit_data", "N/A (no PMA)\n")
    return proc, sys_


@pytest.fixture
def tree(tmp_path):
    clock = [1000.0]
    proc, sys_ = make_tree(tmp_path, 0)
    ctx = CollectorContext(
        proc_root=proc,
        sys_root=sys_,
        watch_dirs={"checkpoint": tmp_path, "data": tmp_path / "missing"},
        rank_processes=lambda: [("job1", 0, 100), ("job1", 1, NEVER_A_PID)],
        clock=lambda: clock[0],
    )

    def advance(seconds: float) -> None:
        clock[0] += seconds
        make_tree(tmp_path, 1)

    return ctx, advance, tmp_path


def test_host_fixture_values_and_utilization(tree):
    ctx, advance, _ = tree
    c = HostCollector(ctx)
    first = c.collect()
    hz = procfs.USER_HZ
    assert value(first, "rankguard_host_cpu_seconds_total", ("user",)) == 1000 / hz
    assert value(first, "rankguard_host_cpu_seconds_total", ("idle",)) == 5000 / hz
    assert {s[0][0] for s in metric(first, "rankguard_host_cpu_seconds_total").samples} == {
        "user",
        "nice",
        "system",
        "idle",
        "iowait",
        "irq",
        "softirq",
        "steal",
    }
    assert value(first, "rankguard_host_cpu_utilization_ratio") == 0.0
    assert value(first, "rankguard_host_cpus") == 2
    assert value(first, "rankguard_host_memory_total_bytes") == 1000 * 1024
    assert value(first, "rankguard_host_memory_available_bytes") == 400 * 1024
    assert value(first, "rankguard_host_load1") == 1.5
    assert value(first, "rankguard_host_load5") == 0.75
    assert value(first, "rankguard_host_load15") == 0.25
    assert value(first, "rankguard_agent_cpu_seconds_total") == (150 + 50) / hz
    assert value(first, "rankguard_agent_resident_memory_bytes") == 2560 * procfs.PAGE_SIZE
    advance(10)
    second = c.collect()
    # 50 busy ticks out of 50 + 250
    assert value(second, "rankguard_host_cpu_utilization_ratio") == pytest.approx(50 / 300)
    assert second.facts["cpu_utilization_ratio"] == pytest.approx(50 / 300)
    assert second.facts["memory_available_ratio"] == pytest.approx(0.4)
    assert second.facts["cpu_count"] == 2 and second.facts["load15"] == 0.25
    assert second.facts["agent_cpu_seconds"] == (250 + 50) / hz


def test_storage_fixture_disks_and_rates(tree):
    ctx, advance, _ = tree
    c = StorageCollector(ctx)
    first = c.collect()
    # loop/zram skipped, vda1 is a partition (not in /sys/block)
    assert [s[0] for s in metric(first, "rankguard_disk_read_bytes_total").samples] == [("vda",)]
    assert value(first, "rankguard_disk_read_bytes_total", ("vda",)) == 2000 * 512
    assert value(first, "rankguard_disk_written_bytes_total", ("vda",)) == 1000 * 512
    assert value(first, "rankguard_disk_reads_completed_total", ("vda",)) == 100
    assert value(first, "rankguard_disk_writes_completed_total", ("vda",)) == 50
    assert value(first, "rankguard_disk_io_time_seconds_total", ("vda",)) == 3.0
    assert first.facts["disks"]["vda"]["read_bytes_per_second"] is None
    advance(2.0)
    second = c.collect()
    vda = second.facts["disks"]["vda"]
    assert second.facts["interval_seconds"] == 2.0
    assert vda["read_bytes_per_second"] == 200 * 512 / 2
    assert vda["written_bytes_per_second"] == 400 * 512 / 2
    assert vda["reads_completed_per_second"] == 5
    assert vda["writes_completed_per_second"] == 2.5
    assert vda["io_utilization_ratio"] == 0.25


def test_storage_without_sys_block_keeps_all_but_loop_and_ram(tree):
    ctx, _, _ = tree
    ctx.sys_root = ctx.sys_root / "absent"
    result = StorageCollector(ctx).collect()
    devices = [s[0][0] for s in metric(result, "rankguard_disk_read_bytes_total").samples]
    assert devices == ["vda", "vda1"]


def test_storage_fixture_filesystems(tree):
    ctx, _, root = tree
    result = StorageCollector(ctx).collect()
    st = os.statvfs(root)
    assert (
        value(result, "rankguard_filesystem_size_bytes", ("checkpoint",))
        == st.f_blocks * st.f_frsize
    )
    assert value(result, "rankguard_filesystem_free_bytes", ("checkpoint",)) > 0
    assert 0 < value(result, "rankguard_filesystem_free_ratio", ("checkpoint",)) <= 1
    # mountpoint/fstype from the fixture's mounts: the longest prefix is the tmp dir itself
    assert metric(result, "rankguard_filesystem_info").samples == [
        (("checkpoint", str(root), str(root), "nfs4"), 1.0)
    ]
    # the missing role is reported, and does not hide the other
    assert "FileNotFoundError" in result.facts["filesystems"]["data"]["error"]
    assert result.facts["filesystems"]["checkpoint"]["fstype"] == "nfs4"


def test_storage_fixture_ranks_rates_and_skips(tree):
    ctx, advance, _ = tree
    c = StorageCollector(ctx)
    first = c.collect()
    assert value(first, "rankguard_rank_read_bytes_total", ("job1", "0")) == 1000
    assert value(first, "rankguard_rank_written_bytes_total", ("job1", "0")) == 500
    assert value(first, "rankguard_rank_storage_read_bytes_total", ("job1", "0")) == 0
    assert value(first, "rankguard_rank_storage_written_bytes_total", ("job1", "0")) == 4096
    (skipped,) = first.facts["ranks_skipped"]
    assert skipped["rank"] == 1 and "gone" in skipped["reason"]
    advance(4.0)
    (rank0,) = c.collect().facts["ranks"]
    assert rank0["read_bytes_per_second"] == 500
    assert rank0["written_bytes_per_second"] == 0
    assert rank0["storage_written_bytes_per_second"] == 1024


def test_storage_unreadable_and_duplicate_ranks_are_skipped(tree, monkeypatch):
    ctx, _, _ = tree
    ctx.rank_processes = lambda: [("job1", 0, 100), ("job1", 0, 100), ("job1", 2, 101)]
    real = procfs.read_pid_io

    def read(root, pid):
        if pid == 101:
            raise PermissionError(f"cannot read {root}/101/io: permission denied")
        return real(root, pid)

    monkeypatch.setattr(procfs, "read_pid_io", read)
    result = StorageCollector(ctx).collect()
    assert [r["rank"] for r in result.facts["ranks"]] == [0]
    reasons = [s["reason"] for s in result.facts["ranks_skipped"]]
    assert reasons[0] == "duplicate rank" and "permission denied" in reasons[1]


def test_storage_stuck_statvfs_times_out_without_blocking(tree):
    ctx, _, _ = tree
    ctx.watch_dirs = {"checkpoint": ctx.proc_root}
    release = threading.Event()

    def hanging_statvfs(path):
        release.wait(5)
        return os.statvfs(path)

    c = StorageCollector(ctx)
    c.statvfs = hanging_statvfs
    c.statvfs_timeout_s = 0.05
    assert "blocked for over" in c.collect().facts["filesystems"]["checkpoint"]["error"]
    assert "still blocked" in c.collect().facts["filesystems"]["checkpoint"]["error"]
    release.set()
    c._stuck[os.path.realpath(ctx.proc_root)].join(5)
    assert c.collect().facts["filesystems"]["checkpoint"]["free_bytes"] > 0


def test_storage_calls_statvfs_directly_only_on_local_filesystems(tree):
    """A thread with a timeout guards a network filesystem's statvfs; a local one (no
    server to hang on) is called in the collector's own thread."""
    ctx, _, root = tree
    ctx.watch_dirs = {"checkpoint": root, "data": Path("/")}  # nfs4 and ext4 in the fixture
    threads = {}

    def recording_statvfs(path):
        threads[path] = threading.current_thread() is threading.main_thread()
        return os.statvfs(path)

    c = StorageCollector(ctx)
    c.statvfs = recording_statvfs
    c.collect()
    assert threads == {os.path.realpath(root): False, "/": True}


def test_network_fixture_interfaces_and_infiniband(tree):
    ctx, advance, _ = tree
    c = NetworkCollector(ctx)
    first = c.collect()
    assert [s[0] for s in metric(first, "rankguard_network_receive_bytes_total").samples] == [
        ("eth0",)
    ]
    expected = {
        "receive_bytes": 10_000,
        "transmit_bytes": 500,
        "receive_packets": 10,
        "transmit_packets": 20,
        "receive_errors": 1,
        "transmit_errors": 3,
        "receive_drops": 2,
        "transmit_drops": 4,
    }
    for stem, v in expected.items():
        assert value(first, f"rankguard_network_{stem}_total", ("eth0",)) == v
    assert value(first, "rankguard_infiniband_receive_bytes_total", ("mlx5_0", "1")) == 4000
    assert value(first, "rankguard_infiniband_transmit_bytes_total", ("mlx5_0", "1")) == 8000
    assert value(first, "rankguard_infiniband_port_up", ("mlx5_0", "1")) == 1
    assert value(first, "rankguard_infiniband_rate_bytes_per_second", ("mlx5_0", "1")) == 25e9
    # counters_ext wins; "N/A" and an empty rate leave their series out
    assert value(first, "rankguard_infiniband_receive_bytes_total", ("mlx5_1", "1")) == 20e9
    assert ("mlx5_1", "1") not in dict(
        metric(first, "rankguard_infiniband_transmit_bytes_total").samples
    )
    assert ("mlx5_1", "1") not in dict(
        metric(first, "rankguard_infiniband_rate_bytes_per_second").samples
    )
    assert value(first, "rankguard_infiniband_port_up", ("mlx5_1", "1")) == 0
    advance(5.0)
    second = c.collect()
    eth0 = second.facts["interfaces"]["eth0"]
    assert eth0["receive_bytes_per_second"] == 800
    assert eth0["transmit_bytes_per_second"] == 200
    assert eth0["receive_errors"] == 1
    ports = {(p["device"], p["port"]): p for p in second.facts["infiniband"]}
    assert ports["mlx5_0", "1"]["receive_bytes_per_second"] == 250 * 4 / 5
    assert ports["mlx5_0", "1"]["state"] == "ACTIVE" and ports["mlx5_1", "1"]["up"] is False


def test_network_without_infiniband(tree):
    ctx, _, _ = tree
    ctx.sys_root = ctx.sys_root / "absent"
    result = NetworkCollector(ctx).collect()
    assert "infiniband" not in result.facts
    assert not [m for m in result.metrics if "infiniband" in m.name]


NAME = re.compile(r"^rankguard_[a-z0-9_]+$")
LABEL = re.compile(r"^[a-z_][a-z0-9_]*$")


def test_metric_names_follow_prometheus_rules(tree):
    ctx, _, _ = tree
    for cls in (HostCollector, StorageCollector, NetworkCollector):
        result = cls(ctx).collect()
        names = [m.name for m in result.metrics]
        assert len(names) == len(set(names)), cls.name
        for m in result.metrics:
            assert NAME.match(m.name), m.name
            assert (m.kind == "counter") == m.name.endswith("_total"), m.name
            assert all(LABEL.match(label) and not label.startswith("__") for label in m.labels)
            keys = [labels for labels, _ in m.samples]
            assert len(keys) == len(set(keys)), f"duplicate series in {m.name}"
            if m.name.endswith("_ratio"):
                assert all(0 <= v <= 1 for _, v in m.samples), m.name


# --- the real machine --------------------------------------------------------------


def test_host_real():
    c = HostCollector(CollectorContext())
    first = c.collect()
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:  # let the tick counters move
        pass
    second = c.collect()
    assert value(first, "rankguard_host_memory_total_bytes") > 0
    assert (
        0
        < value(second, "rankguard_host_memory_available_bytes")
        <= value(second, "rankguard_host_memory_total_bytes")
    )

    def total(r):
        return sum(v for _, v in metric(r, "rankguard_host_cpu_seconds_total").samples)

    assert total(second) > total(first)
    assert 0 <= second.facts["cpu_utilization_ratio"] <= 1
    assert second.facts["cpu_count"] >= 1
    assert second.facts["agent_resident_memory_bytes"] > 0
    assert run_collector(c).success


def test_storage_real(tmp_path):
    ctx = CollectorContext(watch_dirs={"checkpoint": tmp_path, "data": tmp_path / "nope"})
    result = StorageCollector(ctx).collect()
    assert value(result, "rankguard_filesystem_free_bytes", ("checkpoint",)) > 0
    assert value(result, "rankguard_filesystem_size_bytes", ("checkpoint",)) > 0
    (fs_info,) = metric(result, "rankguard_filesystem_info").samples
    assert fs_info[0][2].startswith("/") and fs_info[0][3]  # a mountpoint and an fstype
    assert "error" in result.facts["filesystems"]["data"]
    # a whole disk with reads in /proc/diskstats shows up with nonzero read bytes
    stats = procfs.read_diskstats(Path("/proc"))
    read = dict(metric(result, "rankguard_disk_read_bytes_total").samples)
    busy = [d for d in stats if (Path("/sys/block") / d).exists() and stats[d].read_bytes > 0]
    busy = [d for d in busy if not d.startswith(("loop", "ram", "zram"))]
    if busy:
        assert any(read.get((d,), 0) > 0 for d in busy)


def test_network_real():
    c = NetworkCollector(CollectorContext())
    c.collect()
    result = c.collect()
    devices = [
        labels[0] for labels, _ in metric(result, "rankguard_network_receive_bytes_total").samples
    ]
    assert "lo" not in devices
    for m in result.metrics:
        assert all(v >= 0 for _, v in m.samples)
    for dev in devices:
        assert result.facts["interfaces"][dev]["receive_bytes_per_second"] >= 0


def test_rank_process_io_real(tmp_path):
    target = tmp_path / "out.bin"
    code = (
        "import sys\n"
        f"with open({str(target)!r}, 'wb') as f: f.write(b'x' * (1 << 20))\n"
        "print('written', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-S", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "written"
        ctx = CollectorContext(
            rank_processes=lambda: [("j", 0, proc.pid), ("j", 1, NEVER_A_PID)],
        )
        result = StorageCollector(ctx).collect()
        assert value(result, "rankguard_rank_written_bytes_total", ("j", "0")) >= 1 << 20
        assert value(result, "rankguard_rank_read_bytes_total", ("j", "0")) > 0  # its imports
        assert value(result, "rankguard_rank_storage_written_bytes_total", ("j", "0")) >= 0
        assert [r["pid"] for r in result.facts["ranks"]] == [proc.pid]
        assert [s["pid"] for s in result.facts["ranks_skipped"]] == [NEVER_A_PID]
    finally:
        proc.stdin.close()
        proc.wait(10)


@pytest.mark.parametrize(
    ("mode", "who"),
    [(0o755, None), (0o700, None), (0o775, "group"), (0o757, "others"),
     (0o1777, "group and others")],
)  # fmt: skip
def test_checkpoint_root_permissions_give_a_warning(tree, mode, who):
    ctx, _, root = tree
    os.chmod(root, mode)
    facts = StorageCollector(ctx).collect().facts["filesystems"]
    assert facts["checkpoint"]["mode"] == mode
    warnings = health.permission_warnings(facts)
    if who is None:
        assert warnings == []
    else:
        [w] = warnings
        assert f"writable by {who} (mode {mode:o}" in w.message and str(root) in w.message
    # the data dir is not a checkpoint root: its mode never warns
    assert health.permission_warnings({"data": {**facts["checkpoint"], "mode": 0o777}}) == []
    assert health.permission_warnings({"checkpoint": {"mode": "777"}}) == []  # bad facts: none
