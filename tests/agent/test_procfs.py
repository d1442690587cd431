"""Pure parsers of /proc and /sys files, on literal text copied from real machines."""

from __future__ import annotations

import pytest

from rankguard.agent import procfs
from rankguard.agent.procfs import ProcParseError

STAT = """\
cpu  115280 0 13475 202463 693 0 305 95 0 0
cpu0 50090 0 5691 109987 144 0 123 41 0 0
cpu1 65189 0 7783 92476 548 0 181 53 0 0
intr 883459 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 1 1 15 0 0
ctxt 1150269
btime 1718000000
processes 8330
procs_running 4
procs_blocked 0
"""

MEMINFO = """\
MemTotal:       24684092 kB
MemFree:        22557016 kB
MemAvailable:   22945128 kB
Buffers:            1396 kB
Cached:           572364 kB
SwapTotal:             0 kB
HugePages_Total:       0
HugePages_Free:        0
Hugepagesize:       2048 kB
"""

DISKSTATS = """\
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 254       0 vda 69997 9540 7264082 72208 21289 35165 6924800 21934 0 12564 95520 8086 29 3978688 1079 4691 297
 254       1 vda1 69000 9540 7200000 72000 21000 35000 6900000 21900 0 12500 95400
   8       0 sda 1000 20 40000 500 300 10 8000 700 0 900 1200 0 0 0 0
 253       0 zram0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
"""

NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 23790408875  503568    0    0    0     0          0         0 23790408875  503568    0    0    0     0       0          0
  ifb0:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0
  eth0: 52157116    2030    3    4    0     0          0         0   143883    1381    5    6    0     0       0          0
ib0:12345678901 99 0 0 0 0 0 0 22 1 0 0 0 0 0 0
"""

PID_IO = """\
rchar: 6976
wchar: 10
syscr: 10
syscw: 1
read_bytes: 4096
write_bytes: 8192
cancelled_write_bytes: 0
"""

PID_STAT = (
    "8328 (cat) R 8298 8298 7278 0 -1 4194304 100 0 0 0 7 3 0 0 20 0 1 0 167004 "
    "3133440 385 18446744073709551615 94277202440192 94277202460073 140725423955456 0 0 0 "
    "0 0 0 0 0 0 17 1 0 0 0 0 0 94277202476080 94277202477696 94277469900800 "
    "140725423962642 140725423962662 140725423962662 140725423964139 0\n"
)

MOUNTS = """\
proc /proc proc rw,relatime 0 0
/dev/vda / ext4 rw,relatime,discard 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24684092k 0 0
server:/ckpt /mnt/my\\040checkpoints nfs4 rw,relatime,vers=4.2 0 0
/dev/nvme0n1 /data xfs rw 0 0
/dev/nvme1n1 /data xfs rw 0 0
"""


def test_stat_cpu_seconds_and_count():
    cpu = procfs.parse_stat(STAT, clk_tck=100)
    assert cpu.cpus == 2
    assert cpu.seconds["user"] == pytest.approx(1152.80)
    assert cpu.seconds["idle"] == pytest.approx(2024.63)
    assert cpu.seconds["steal"] == pytest.approx(0.95)
    assert set(cpu.seconds) == set(procfs.CPU_MODES)
    # busy = everything but idle and iowait (guest is inside user already)
    assert cpu.busy_seconds == pytest.approx((115280 + 13475 + 305 + 95) / 100)
    assert cpu.total_seconds == pytest.approx((115280 + 13475 + 202463 + 693 + 305 + 95) / 100)


def test_stat_old_kernel_with_four_columns():
    cpu = procfs.parse_stat("cpu 10 20 30 40\ncpu0 10 20 30 40\n", clk_tck=10)
    assert cpu.seconds == {"user": 1.0, "nice": 2.0, "system": 3.0, "idle": 4.0}


def test_meminfo_bytes():
    mem = procfs.parse_meminfo(MEMINFO)
    assert mem["MemTotal"] == 24684092 * 1024
    assert mem["MemAvailable"] == 22945128 * 1024
    assert mem["HugePages_Total"] == 0  # a count, not kB
    assert mem["Hugepagesize"] == 2048 * 1024


def test_loadavg():
    load = procfs.parse_loadavg("2.29 1.67 0.95 4/104 8324\n")
    assert (load.load1, load.load5, load.load15) == (2.29, 1.67, 0.95)


def test_diskstats_field_variants():
    disks = procfs.parse_diskstats(DISKSTATS)
    assert set(disks) == {"loop0", "vda", "vda1", "sda", "zram0"}
    vda = disks["vda"]  # 20 fields (Linux >= 5.5)
    assert vda.reads_completed == 69997
    assert vda.read_bytes == 7264082 * 512
    assert vda.writes_completed == 21289
    assert vda.written_bytes == 6924800 * 512
    assert vda.io_time_ms == 12564
    assert disks["vda1"].io_time_ms == 12500  # 14 fields (before 4.18)
    assert disks["sda"].read_bytes == 40000 * 512  # 18 fields (4.18 .. 5.4)


def test_net_dev():
    net = procfs.parse_net_dev(NET_DEV)
    assert set(net) == {"lo", "ifb0", "eth0", "ib0"}
    eth = net["eth0"]
    assert (eth.rx_bytes, eth.rx_packets, eth.rx_errs, eth.rx_drop) == (52157116, 2030, 3, 4)
    assert (eth.tx_bytes, eth.tx_packets, eth.tx_errs, eth.tx_drop) == (143883, 1381, 5, 6)
    assert net["ib0"].rx_bytes == 12345678901  # name glued to the first counter
    assert net["ib0"].tx_bytes == 22


def test_pid_io():
    io = procfs.parse_pid_io(PID_IO)
    assert (io.rchar, io.wchar, io.read_bytes, io.write_bytes) == (6976, 10, 4096, 8192)


def test_pid_stat():
    st = procfs.parse_pid_stat(PID_STAT, clk_tck=100, page_size=4096)
    assert (st.pid, st.comm, st.state, st.ppid) == (8328, "cat", "R", 8298)
    assert st.utime_seconds == pytest.approx(0.07)
    assert st.stime_seconds == pytest.approx(0.03)
    assert st.num_threads == 1
    assert st.starttime_seconds == pytest.approx(1670.04)
    assert st.rss_bytes == 385 * 4096


def test_pid_stat_comm_with_spaces_and_parentheses():
    text = PID_STAT.replace("(cat)", "(evil ) R 1 (x) y)")
    st = procfs.parse_pid_stat(text, clk_tck=100)
    assert st.comm == "evil ) R 1 (x) y"
    assert (st.pid, st.state, st.ppid) == (8328, "R", 8298)
    assert st.utime_seconds == pytest.approx(0.07)


# A rank's main thread asleep in time.sleep (copied from a real machine, Linux 6.18): the
# three files the agent reads for the main thread's own state
SCHEDSTAT = "62402766 18277020 83\n"
SYSCALL_ASLEEP = (
    "230 0x1 0x1 0x7fff249f5b30 0x0 0x0 0x0 0x7fff249f5af0 0x7f19170ed545\n"  # clock_nanosleep
)


def test_thread_files():
    assert procfs.parse_schedstat(SCHEDSTAT) == pytest.approx(0.062402766)
    assert procfs.parse_wchan("hrtimer_nanosleep") == "hrtimer_nanosleep"
    assert procfs.parse_wchan("0") is None  # running (or hidden from us)
    assert procfs.parse_syscall(SYSCALL_ASLEEP) == "230"
    assert procfs.parse_syscall("running\n") == "running"
    assert procfs.parse_syscall("-1 0x7ffd1c6e1e38 0x7f0a4c2d3e4f\n") == "-1"


def test_read_thread_of_a_fixture_tree(tmp_path, monkeypatch):
    task = tmp_path / "7" / "task" / "7"
    task.mkdir(parents=True)
    (task / "schedstat").write_text(SCHEDSTAT)
    (task / "wchan").write_text("hrtimer_nanosleep")
    (task / "syscall").write_text(SYSCALL_ASLEEP)
    t = procfs.read_thread(tmp_path, 7, 7)
    assert (t.wchan, t.syscall) == ("hrtimer_nanosleep", "230")
    assert t.run_seconds == pytest.approx(0.062402766)
    (task / "syscall").unlink()  # unreadable or absent: unknown, not a failure
    assert procfs.read_thread(tmp_path, 7, 7).syscall is None
    with pytest.raises(ProcessLookupError, match="process 7 is gone"):
        procfs.read_thread(tmp_path, 7, 8)


def test_mounts_unescape_and_longest_prefix():
    mounts = procfs.parse_mounts(MOUNTS)
    assert mounts[3].mountpoint == "/mnt/my checkpoints"
    find = procfs.find_mount
    assert find(mounts, "/mnt/my checkpoints/run1").fstype == "nfs4"
    assert find(mounts, "/mnt/my checkpointsX").mountpoint == "/"  # not a path prefix
    assert find(mounts, "/dev/shm").fstype == "tmpfs"
    assert find(mounts, "/data/x").source == "/dev/nvme1n1"  # the later mount hides the earlier
    assert find(mounts, "/home/u").mountpoint == "/"
    assert find([], "/x") is None


def test_infiniband_files():
    assert procfs.parse_ib_state("4: ACTIVE\n") == (4, "ACTIVE")
    assert procfs.parse_ib_state("1: DOWN\n") == (1, "DOWN")
    assert procfs.parse_ib_rate("200 Gb/sec (4X HDR)\n") == 200e9 / 8
    assert procfs.parse_ib_rate("2.5 Gb/sec (1X SDR)\n") == 2.5e9 / 8
    assert procfs.parse_counter("123456789012\n") == 123456789012
    assert procfs.parse_counter("N/A (no PMA)\n") is None


def test_per_second():
    assert procfs.per_second(None, 10, 1.0) is None
    assert procfs.per_second(10, 30, 2.0) == 10.0
    assert procfs.per_second(100, 30, 2.0) == 15.0  # a reset: the new value is the increase
    assert procfs.per_second(10, 30, 0.0) is None


@pytest.mark.parametrize(
    ("parser", "text", "file", "lineno"),
    [
        (procfs.parse_stat, "intr 1 2\n", "/proc/stat", None),
        (procfs.parse_stat, "cpu 1 2 x 4\n", "/proc/stat", 1),
        (procfs.parse_stat, "cpu 1 2\n", "/proc/stat", 1),
        (procfs.parse_meminfo, "MemTotal: 10 kB\nMemFree 5 kB\n", "/proc/meminfo", 2),
        (procfs.parse_meminfo, "MemTotal: ten kB\n", "/proc/meminfo", 1),
        (procfs.parse_meminfo, "MemTotal: 10 MB\n", "/proc/meminfo", 1),
        (procfs.parse_meminfo, "MemFree: 10 kB\n", "/proc/meminfo", None),
        (procfs.parse_loadavg, "2.29 1.67\n", "/proc/loadavg", 1),
        (procfs.parse_loadavg, "a b c 1/2 3\n", "/proc/loadavg", 1),
        (procfs.parse_diskstats, "   8 0 sda 1 2 3\n", "/proc/diskstats", 1),
        (procfs.parse_diskstats, "8 0 sda 1 2 3 4 5 6 7 8 9 x 11\n", "/proc/diskstats", 1),
        (procfs.parse_net_dev, "  eth0: 1 2 3\n", "/proc/net/dev", 1),
        (procfs.parse_net_dev, "eth0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16\n", "/proc/net/dev", 1),
        (procfs.parse_pid_io, "rchar: 1\nwchar: 2\n", "/proc/<pid>/io", None),
        (procfs.parse_pid_io, "rchar 1\n", "/proc/<pid>/io", 1),
        (procfs.parse_pid_stat, "8328 cat R 1 2 3\n", "/proc/<pid>/stat", 1),
        (procfs.parse_pid_stat, "8328 (cat) R 1 2\n", "/proc/<pid>/stat", 1),
        (procfs.parse_schedstat, "62402766 18277020\n", "/proc/<pid>/schedstat", 1),
        (procfs.parse_schedstat, "a b c\n", "/proc/<pid>/schedstat", 1),
        (procfs.parse_syscall, "sleeping 0x1\n", "/proc/<pid>/syscall", 1),
        (procfs.parse_syscall, "", "/proc/<pid>/syscall", 1),
        (procfs.parse_mounts, "/dev/vda /\n", "/proc/self/mounts", 1),
        (procfs.parse_ib_state, "ACTIVE\n", "state", 1),
        (procfs.parse_ib_rate, "fast\n", "rate", 1),
        (procfs.parse_counter, "12x\n", "counter", 1),
    ],
)
def test_malformed_input_names_file_and_line(parser, text, file, lineno):
    with pytest.raises(ProcParseError) as err:
        parser(text)
    assert isinstance(err.value, ValueError)
    assert err.value.file == file and err.value.lineno == lineno
    assert str(err.value).startswith(file)


def test_error_names_the_real_path(tmp_path):
    (tmp_path / "loadavg").write_text("garbage\n")
    with pytest.raises(ProcParseError, match=str(tmp_path / "loadavg") + ":1"):
        procfs.read_loadavg(tmp_path)


def test_pid_readers_explain_vanished_and_unreadable(tmp_path, monkeypatch):
    with pytest.raises(ProcessLookupError, match="process 4242 is gone"):
        procfs.read_pid_io(tmp_path, 4242)
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "io").write_text(PID_IO)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    # the agent runs as root here, so chmod cannot make a file unreadable
    monkeypatch.setattr(procfs, "open", denied, raising=False)
    with pytest.raises(PermissionError, match="CAP_SYS_PTRACE"):
        procfs.read_pid_io(tmp_path, 7)
