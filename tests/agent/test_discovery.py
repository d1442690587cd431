"""Zero-code protection, fast parts: finding torchrun workers in /proc (pure parsing and
grouping on literal data, the scanner on a fixture /proc tree), the rank table taking them
(real child processes), and the process-hang detector on literal observations."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from rankguard.agent.discovery import (
    MAX_ENVIRON_BYTES,
    Worker,
    WorkerScanner,
    assign_jobs,
    belongs_here,
    is_launcher_cmdline,
    parse_environ,
    worker_from_environ,
)
from rankguard.agent.ranks import RankTable, describe_exit, parse_proc_stat, read_proc_stat
from rankguard.contract.telemetry import Collective, TelemetryRecord
from rankguard.supervisor.detectors import DetectorConfig, hang, process_hang
from rankguard.supervisor.model import RANK_HUNG, History
from rankguard.supervisor.state import ClusterObs, NodeObs, RankObs

TORCHRUN = b"/usr/bin/python3\0-m\0torch.distributed.run\0--nproc-per-node=2\0train.py\0"


def environ(**env) -> bytes:
    base = {"PATH": "/usr/bin", "HOME": "/root"}
    base.update(env)
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in base.items())


def worker(pid, launcher, run_id="job", rank=0, restart=0, launcher_start=100) -> Worker:
    return Worker(pid, 1000 + pid, launcher, launcher_start, run_id, rank, rank, 2, restart)


# --------------------------------------------------------------------------- parsing


def test_parse_environ_keeps_only_the_wanted_keys_first_one_wins():
    data = environ(RANK="1", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="abc", SECRET="x")
    data += b"RANK=7\0garbage-without-equals\0\xff\xfe=1\0"
    env = parse_environ(data)
    assert env == {"RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "abc"}


def test_parse_environ_is_bounded():
    data = b"A=" + b"x" * (2 * MAX_ENVIRON_BYTES) + b"\0RANK=1\0"
    assert parse_environ(data) == {}  # RANK lies beyond the bound: never read


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2",
          "TORCHELASTIC_RESTART_COUNT": "3"}, (1, 1, 2, 3, "r")),
        ({"RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "r"}, (0, 0, 1, 0, "r")),
        ({"RANK": "0", "LOCAL_RANK": "0"}, None),  # not started by torchrun
        ({"RANK": "x", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "r"}, None),
        ({"RANK": "-1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "r"}, None),
        ({"RANK": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2"}, None),
        ({"RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "  "}, None),
    ],
)  # fmt: skip
def test_worker_from_environ(env, expected):
    w = worker_from_environ(10, 500, 9, 400, env)
    if expected is None:
        assert w is None
    else:
        assert (w.rank, w.local_rank, w.world_size, w.restart, w.run_id) == expected
        assert (w.pid, w.start_ticks, w.launcher, w.launcher_start) == (10, 500, 9, 400)


@pytest.mark.parametrize(
    "cmdline, expected",
    [
        (TORCHRUN, True),
        (b"/venv/bin/torchrun\0--nproc-per-node=2\0train.py\0", True),
        (b"python3\0/venv/bin/torchrun\0train.py\0", True),
        (b"python3\0-u\0-m\0torch.distributed.run\0x.py\0", True),
        (b"python3\0train.py\0torchrun\0", False),  # an argument named torchrun is not it
        (b"python3\0-m\0rankguard.trainer\0", False),
        (b"", False),
    ],
)
def test_is_launcher_cmdline(cmdline, expected):
    assert is_launcher_cmdline(cmdline) is expected


def test_assign_jobs_keeps_jobs_apart_by_launcher():
    owners: OrderedDict = OrderedDict()
    found = [
        worker(11, 10, "shared", 0), worker(12, 10, "shared", 1),
        worker(21, 20, "shared", 0, launcher_start=200),  # a second launcher, same run id
        worker(31, 30, "none", 0), worker(41, 40, "none", 0),  # torchrun's default run id
    ]  # fmt: skip
    jobs = {(job, w.rank, w.pid) for job, w in assign_jobs(found, owners)}
    assert jobs == {("shared", 0, 11), ("shared", 1, 12), ("shared@20", 0, 21),
                    ("torchrun-30", 0, 31), ("torchrun-40", 0, 41)}  # fmt: skip
    # the first launcher keeps its name on later scans, whatever order they come in
    again = assign_jobs([worker(21, 20, "shared", 0, 200), worker(11, 10, "shared")], owners)
    assert {(j, w.pid) for j, w in again} == {("shared", 11), ("shared@20", 21)}


def test_parse_proc_stat_reads_the_exit_code_and_describe_exit():
    fields = ["Z", "1"] + ["0"] * 47 + ["9"]  # field 52: waitpid status 9 (SIGKILL)
    stat = parse_proc_stat("42 (python) " + " ".join(fields))
    assert stat.state == "Z" and stat.exit_code == 9
    assert describe_exit(9) == "killed by SIGKILL"
    assert describe_exit(1 << 8) == "exit code 1"
    assert parse_proc_stat("42 (x) " + " ".join(["S"] + ["0"] * 20)).exit_code is None


# --------------------------------------------------------------------------- scanner


def _proc(root: Path, pid: int, ppid: int, start: int, cmdline: bytes, env: bytes | None):
    d = root / str(pid)
    d.mkdir()
    rest = ["S", str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 30
    (d / "stat").write_text(f"{pid} (python3) " + " ".join(rest))
    (d / "cmdline").write_bytes(cmdline)
    if env is not None:
        (d / "environ").write_bytes(env)


def test_scanner_finds_workers_of_torchrun_launchers_only(tmp_path):
    worker_env = environ(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="j1")
    _proc(tmp_path, 1, 0, 1, b"/sbin/init\0", b"")
    _proc(tmp_path, 10, 1, 100, TORCHRUN, environ())
    _proc(tmp_path, 11, 10, 110, b"python3\0train.py\0", worker_env)
    _proc(tmp_path, 12, 10, 111, b"python3\0train.py\0",
          environ(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="j1"))  # fmt: skip
    _proc(tmp_path, 13, 11, 120, b"python3\0loader\0", worker_env)  # a worker's own child
    _proc(tmp_path, 20, 1, 200, b"bash\0", environ())
    _proc(tmp_path, 21, 20, 210, b"python3\0fake.py\0", worker_env)  # parent is no torchrun
    (tmp_path / "self").mkdir()
    scanner = WorkerScanner(tmp_path)
    found = scanner.scan()
    assert [(j, w.pid, w.rank, w.launcher) for j, w in found] == [("j1", 11, 0, 10),
                                                                   ("j1", 12, 1, 10)]  # fmt: skip
    # pids the table knows by telemetry, and launchers whose workers speak it, are skipped
    assert [w.pid for _, w in scanner.scan(skip={11}.__contains__)] == [12]
    assert scanner.scan(skip_launcher={10}.__contains__) == []


def test_scanner_watches_only_workers_that_name_its_socket(tmp_path):
    """Several agents on one machine (tests, network namespaces) each watch their own."""

    def env(rank, **extra):
        return environ(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3",
                       TORCHELASTIC_RUN_ID="j", **extra)  # fmt: skip

    _proc(tmp_path, 10, 1, 100, TORCHRUN, environ())
    _proc(tmp_path, 11, 10, 110, b"python3\0t.py\0", env(0, RANKGUARD_TELEMETRY_SOCKET="/r/a.sock"))
    _proc(tmp_path, 12, 10, 111, b"python3\0t.py\0", env(1, RANKGUARD_TELEMETRY_SOCKET="/r/b.sock"))
    _proc(tmp_path, 13, 10, 112, b"python3\0t.py\0", env(2))
    mine = WorkerScanner(tmp_path, agent_socket="/r/a.sock")
    assert [w.pid for _, w in mine.scan()] == [11]
    assert [w.pid for _, w in WorkerScanner(tmp_path, "/r/a.sock", "all").scan()] == [11, 13]
    assert WorkerScanner(tmp_path, "/r/a.sock", "off").scan() == []


def test_belongs_here():
    default = "/run/rankguard/telemetry.sock"
    assert belongs_here(None, default) and not belongs_here(None, "/tmp/x.sock")
    assert belongs_here(None, "/tmp/x.sock", "all") and not belongs_here(None, default, "off")
    assert belongs_here("/tmp//x.sock", "/tmp/x.sock")
    assert not belongs_here("/tmp/y.sock", "/tmp/x.sock", "all")
    w = worker_from_environ(5, 1, 4, 1, {"RANK": "0", "LOCAL_RANK": "0",
                                        "TORCHELASTIC_RUN_ID": "r",
                                        "RANKGUARD_TELEMETRY_SOCKET": "off"})  # fmt: skip
    assert w.socket is None  # telemetry off names no agent


# --------------------------------------------------------------------------- table


def _telemetry(pid: int, job: str = "job", rank: int = 1) -> TelemetryRecord:
    return TelemetryRecord(
        v=1, job=job, rank=rank, local_rank=rank, world_size=2, pid=pid, restart=0, step=5,
        phase="train", time=time.time(), step_seconds=0.1, data_wait_seconds=0.0,
        compute_seconds=0.08, comm_seconds=0.02, comm_exposed_seconds=0.0,
        optimizer_seconds=0.0, checkpoint_block_seconds=0.0, tokens_per_second=1.0, mfu=0.0,
        peak_memory_bytes=0, loss=1.0, checkpoint_step=None,
    )  # fmt: skip


@contextlib.contextmanager
def _child(code: str = "import time; time.sleep(60)"):
    """A child process running `code`, killed (if still running) and reaped at the end."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _found(proc: subprocess.Popen, rank: int = 1, job: str = "job", restart: int = 0):
    stat = read_proc_stat(proc.pid)
    w = Worker(proc.pid, stat.start_ticks, os.getpid(), 1, job, rank, rank, 2, restart)
    return [(job, w)]


def _wait(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _row(table: RankTable, job: str = "job", rank: int = 1) -> dict | None:
    return next((r for r in table.snapshot() if (r["job"], r["rank"]) == (job, rank)), None)


def test_table_watches_a_found_worker_without_steps_and_knows_its_exit():
    with RankTable() as table, _child() as proc:
        assert table.adopt(_found(proc)) == 1
        assert table.adopt(_found(proc)) == 0  # already watched
        row = _row(table)
        assert row["source"] == "process" and row["state"] == "alive"
        assert row["step"] is None and row["heartbeat_age_seconds"] is None
        assert table.verified_pid("job", 1) == proc.pid  # control actions can target it
        os.kill(proc.pid, signal.SIGSTOP)
        _wait(lambda: (table.refresh(), _row(table)["state"])[1] == "stopped")
        os.kill(proc.pid, signal.SIGKILL)
        _wait(lambda: _row(table)["state"] in ("zombie", "exited"))
        assert _row(table)["state_detail"] == "killed by SIGKILL"


def test_table_a_worker_that_exits_0_finished_and_a_restart_replaces_the_process():
    with RankTable() as table:
        with _child("import time; time.sleep(0.5)") as first:
            table.adopt(_found(first))
            # the status is read from the zombie: its parent (here: us) reaps it only after
            _wait(lambda: _row(table)["state"] == "finished")
        with _child() as second:
            table.adopt(_found(second, restart=1))
            row = _row(table)
            assert (row["pid"], row["restart"], row["state"]) == (second.pid, 1, "alive")
            assert row["process_changes"] == 1


def test_table_a_found_worker_that_sends_telemetry_is_one_rank():
    with RankTable() as table, _child() as proc:
        table.adopt(_found(proc, job="uuid-1"))
        assert _row(table, "uuid-1")["source"] == "process"
        table.update(_telemetry(proc.pid, job="trainer-job"), sender_pid=proc.pid)
        rows = table.snapshot()
        assert [(r["job"], r["source"]) for r in rows] == [("trainer-job", "telemetry")]
        # later scans leave it alone: its pid speaks telemetry
        assert table.adopt(_found(proc, job="uuid-1")) == 0
        assert len(table.snapshot()) == 1


WATCH_FRONT = (Collective("0", "default_pg", 13, 12, "gloo:all_reduce", "[[4]]", 1800.0),)


def _watch_record(**kw):
    """A record of a zero-code worker's collective watch (progress false)."""
    return dataclasses.replace(_telemetry(1, job="run-id"), progress=False, **kw)


def test_table_a_found_workers_wavefront_is_its_evidence_and_it_stays_a_process_rank():
    """A zero-code worker's collective watch (client/collective_watch.py) names the job by
    torchrun's run id, which the table may hold under another name: the record is matched
    by the kernel-verified sender pid, and the worker stays a process rank."""
    front = WATCH_FRONT
    evidence = _watch_record(step=0, collectives=front)
    with RankTable() as table, _child() as proc:
        table.adopt(_found(proc, job="run-id@7"))
        table.update(dataclasses.replace(evidence, pid=proc.pid), sender_pid=proc.pid)
        rows = table.snapshot()
        assert [(r["job"], r["source"]) for r in rows] == [("run-id@7", "process")]
        (answer,) = table.answers()
        assert answer.collectives == front and answer.step is None
        # from a process it does not know, evidence registers a rank as before
        table.update(dataclasses.replace(evidence, pid=os.getpid()), sender_pid=os.getpid())
        assert len(table.snapshot()) == 2


def test_table_a_found_workers_step_beacon_is_its_script_step_and_nothing_else():
    """The watch's beacon (collectives null, the script's optimizer step): the found
    worker's `script_step`, its wavefront and its step untouched; from a process the
    table does not know, nothing is registered."""
    front = WATCH_FRONT
    beacon = _watch_record(step=137, collectives=None)
    with RankTable() as table, _child() as proc:
        table.adopt(_found(proc, job="run-id@7"))
        evidence = dataclasses.replace(beacon, pid=proc.pid, step=0, collectives=front)
        table.update(evidence, sender_pid=proc.pid)
        table.update(dataclasses.replace(beacon, pid=proc.pid), sender_pid=proc.pid)
        (answer,) = table.answers()
        assert (answer.source, answer.script_step, answer.step) == ("process", 137, None)
        assert answer.collectives == front  # a beacon takes no wavefront back
        assert answer.to_json()["script_step"] == 137
        table.update(dataclasses.replace(beacon, pid=os.getpid()), sender_pid=os.getpid())
        assert len(table.snapshot()) == 1


# --------------------------------------------------------------------------- detector


def robs(rank: int, state: str = "alive", **kw) -> RankObs:
    base = dict(
        node="n", job="job", rank=rank, world_size=2, pid=100 + rank, restart=0, state=state,
        step=None, phase=None, heartbeat_age_seconds=None, exited_at=None, step_seconds=None,
        compute_seconds=None, comm_seconds=None, comm_compute_ratio=None, loss=None,
        checkpoint_step=None, cpu_utilization=0.0, source="process", state_since=900.0,
        cpu_active_at=999.0,
    )  # fmt: skip
    base.update(kw)
    return RankObs(**base)


def cluster(*ranks: RankObs, now: float = 1000.0) -> ClusterObs:
    return ClusterObs(time=now, nodes=(NodeObs("n", "http://a", True, now, ranks=ranks),))


CFG = DetectorConfig()


def test_a_stopped_rank_is_the_culprit_after_the_stop_budget():
    obs = cluster(robs(0), robs(1, "stopped", state_since=997.0))
    (f,) = process_hang.detect(obs, History(), CFG)
    assert f.kind == RANK_HUNG and f.rank == 1 and f.node == "n"
    assert f.evidence["pid"] == 101 and f.evidence["node_url"] == "http://a"
    assert not f.evidence["stacks_needed"] and f.key == "rank_hung:job:0:process"
    # stopped only a moment ago: not yet
    assert process_hang.detect(cluster(robs(0), robs(1, "stopped", state_since=999.5)),
                               History(), CFG) == []  # fmt: skip
    # the step-based detector leaves such jobs alone
    assert hang.detect(obs, History(), CFG) == []


def test_no_cpu_progress_all_but_one_names_the_busy_rank_all_idle_needs_stacks():
    idle = 1000.0 - CFG.process_hang.idle_seconds - 1
    (f,) = process_hang.detect(
        cluster(robs(0, cpu_active_at=idle), robs(1, cpu_utilization=1.0)), History(), CFG
    )
    assert f.rank == 1 and not f.evidence["stacks_needed"]
    (g,) = process_hang.detect(
        cluster(robs(0, cpu_active_at=idle), robs(1, cpu_active_at=idle)), History(), CFG
    )
    assert g.rank is None and g.evidence["stacks_needed"]
    # the last rank went idle just after the others (it blocked in their collective): it is
    # not blamed for CPU it no longer uses; "all idle" and the stacks decide a moment later
    assert (
        process_hang.detect(
            cluster(robs(0, cpu_active_at=idle), robs(1, cpu_active_at=idle + 1.5)), History(), CFG
        )
        == []
    )
    # one idle rank of three is not a hang; nor is a lone idle rank; nor a dead job
    assert process_hang.detect(cluster(robs(0, cpu_active_at=idle), robs(1), robs(2)),
                               History(), CFG) == []  # fmt: skip
    assert process_hang.detect(cluster(robs(0, cpu_active_at=idle)), History(), CFG) == []
    assert process_hang.detect(cluster(robs(0, cpu_active_at=idle), robs(1, "exited")),
                               History(), CFG) == []  # fmt: skip


def test_telemetry_ranks_are_not_judged_by_process():
    obs = cluster(robs(0, source="telemetry"), robs(1, "stopped", source="telemetry"))
    assert process_hang.detect(obs, History(), CFG) == []


def test_up_shows_the_scripts_traceback_not_torchruns():
    from rankguard.cli.up import last_traceback

    log = """step 1
Traceback (most recent call last):
  File "/tmp/broken.py", line 1, in <module>
    import nope
ModuleNotFoundError: No module named 'nope'
E1122 12:00:00 failed (exitcode: 1) local_rank: 0 (pid: 123) of binary: python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
"""
    assert last_traceback(log) == (
        "Traceback (most recent call last):\n"
        '  File "/tmp/broken.py", line 1, in <module>\n'
        "    import nope\n"
        "ModuleNotFoundError: No module named 'nope'"
    )
    assert last_traceback("all good\n") is None


def test_up_shows_a_traceback_that_another_ranks_lines_cut_into():
    from rankguard.cli.up import last_traceback

    # as seen in CI: two ranks failing at once, one's caret line joined to the other's
    log = """Traceback (most recent call last):
Traceback (most recent call last):
  File "/tmp/broken.py", line 1, in <module>
    import nope
^^^^  File "/tmp/broken.py", line 1, in <module>
    import nope
ModuleNotFoundError: No module named 'nope'
ModuleNotFoundError: No module named 'nope'
"""
    error = last_traceback(log)
    assert error is not None and error.endswith("ModuleNotFoundError: No module named 'nope'")
    assert "^^^^" not in error
    # a traceback cut off before its exception line gives way to an earlier whole one
    assert last_traceback(log + "Traceback (most recent call last):\n  File 'x'\n") == error
