"""Stand-ins (agent/stand_ins.py, supervisor/detectors/stand_in.py): the process torchrun
watches in place of a warm-started rank. The state rule on literal data; the rank table
and the kill action with real processes (a fake launcher, its shim, a rank holding a
pidfd on the shim, as trainer/warm.py's workers do); the detector on literal observations."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from rankguard.agent.control import send_signal
from rankguard.agent.ranks import ProcessWatcher, ProcStat, RankTable
from rankguard.agent.stand_ins import StandIn, stand_in_state
from rankguard.contract import ContractError, RankAnswer
from rankguard.contract.telemetry import TelemetryRecord
from rankguard.supervisor.detectors import DetectorConfig, stand_in
from rankguard.supervisor.detectors.process_hang import ProcessHangConfig
from rankguard.supervisor.model import RANK_HUNG, History
from rankguard.supervisor.state import ClusterObs, NodeObs, RankObs


def stat(state: str, start: int = 7) -> ProcStat:
    return ProcStat(state, 1, 0.0, start)


@pytest.mark.parametrize(
    ("proc", "expected"),
    [(stat("S"), "alive"), (stat("R"), "alive"), (stat("D"), "alive"), (stat("T"), "stopped"),
     (stat("t"), "stopped"), (stat("Z"), "gone"), (None, "gone"), (stat("S", start=8), "gone")],
)  # fmt: skip
def test_stand_in_state(proc, expected):
    assert stand_in_state(proc, 7) == expected


def test_stand_in_keeps_when_its_state_changed():
    s = StandIn(pid=5, start_ticks=7, state="alive", state_since=10.0)
    s.observe(stat("S"), 11.0)
    assert (s.state, s.state_since, s.watched) == ("alive", 10.0, True)
    s.observe(stat("T"), 12.0)
    s.observe(stat("T"), 13.0)
    assert (s.state, s.state_since) == ("stopped", 12.0)
    s.observe(None, 14.0)
    assert (s.state, s.watched) == ("gone", False)
    assert s.answer(1000.0).to_json() == {"pid": 5, "state": "gone", "state_since": 1014.0}


# --------------------------------------------------------------------------- real processes

LAUNCHER = """
import subprocess, sys, time
shim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(shim.pid, flush=True)
shim.wait()
time.sleep(120)
"""
RANK = ("import os, sys, time; fd = os.pidfd_open(int(sys.argv[1])); m = b\"x\" * int(sys.argv[3])"
        "; time.sleep(float(sys.argv[2]))")  # fmt: skip


def record(pid: int, phase: str = "train") -> TelemetryRecord:
    return TelemetryRecord(
        v=1, job="job", rank=1, local_rank=1, world_size=2, pid=pid, restart=0, step=5,
        phase=phase, time=time.time(), step_seconds=0.1, data_wait_seconds=0.0,
        compute_seconds=0.08, comm_seconds=0.02, comm_exposed_seconds=0.0,
        optimizer_seconds=0.0, checkpoint_block_seconds=0.0, tokens_per_second=1.0, mfu=0.0,
        peak_memory_bytes=0, loss=1.0, checkpoint_step=None,
    )  # fmt: skip


def wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):  # reaped before or while reading
        return True


def holds_pidfd(pid: int) -> bool:
    """Whether a process has a pidfd open; its other descriptors (the interpreter's own)
    may close between the listing and the look."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[pidfd]":
                return True
    return False


@pytest.fixture
def chain():
    """A process whose command line says torchrun, its child (the shim), and a rank that
    is not torchrun's child but holds a pidfd on the shim."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, "torchrun-like"],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    shim = int(launcher.stdout.readline())
    procs = [launcher]

    def rank(seconds: float = 120.0, memory: int = 0) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, str(shim), str(seconds),
                                       str(memory)]))  # fmt: skip
        wait(lambda: holds_pidfd(procs[-1].pid))
        return procs[-1]

    yield shim, rank
    for p in [*procs]:
        p.kill()
        p.wait()
    if not gone(shim):  # orphaned when the launcher is killed
        os.kill(shim, signal.SIGKILL)


def row(table: RankTable) -> dict:
    return next(r for r in table.snapshot() if (r["job"], r["rank"]) == ("job", 1))


def test_table_watches_a_ranks_stand_in_and_sigkill_ends_both(chain):
    shim, start_rank = chain
    with RankTable() as table:
        rank = start_rank()
        table.update(record(rank.pid), sender_pid=rank.pid)
        assert row(table)["stand_in"]["pid"] == shim
        assert row(table)["stand_in"]["state"] == "alive"
        os.kill(shim, signal.SIGSTOP)
        wait(lambda: (table.refresh(), row(table)["stand_in"]["state"] == "stopped")[1])
        assert row(table)["state"] == "alive"  # the rank itself trains on
        # SIGTERM is for the rank (the shim forwards it): the stand-in is not touched
        assert "stand_in" not in send_signal(table, {"job": "job", "rank": 1, "signal": "SIGCONT"})
        out = send_signal(table, {"job": "job", "rank": 1, "signal": "SIGKILL"})
        assert (out["stand_in"], out["pid"]) == (shim, rank.pid)
        wait(lambda: gone(shim) and rank.poll() is not None)


def test_sigkill_ends_the_rank_before_its_stand_in(chain):
    """torchrun tears the peers down when the stand-in dies, so the killed rank must be gone
    first: else a peer can die before it and be named as the dead rank (seen under load
    with `rankguard inject kill`, docs/architecture.md). The rank holds 64 MiB, so its
    exit takes longer than the shim's, as a trainer's does."""
    shim, start_rank = chain
    order = []
    watcher = ProcessWatcher(lambda pid, _: order.append(pid))
    try:
        with RankTable() as table:
            rank = start_rank(memory=64 << 20)
            table.update(record(rank.pid), sender_pid=rank.pid)
            assert watcher.watch(rank.pid) and watcher.watch(shim)
            out = send_signal(table, {"job": "job", "rank": 1, "signal": "SIGKILL"})
            assert (out["stand_in"], out["pid"]) == (shim, rank.pid)
            wait(lambda: len(order) == 2)
    finally:
        watcher.close()
    assert order == [rank.pid, shim]


def test_a_finished_rank_whose_stand_in_is_stopped_has_the_stand_in_killed(chain):
    shim, start_rank = chain
    with RankTable() as table:
        rank = start_rank(seconds=2.0)  # time to register before it ends, under load too
        table.update(record(rank.pid, phase="done"), sender_pid=rank.pid)
        os.kill(shim, signal.SIGSTOP)
        rank.wait()
        wait(lambda: (table.refresh(), row(table)["state"] == "finished")[1])
        wait(lambda: (table.refresh(), row(table)["stand_in"]["state"] == "stopped")[1])
        out = send_signal(table, {"job": "job", "rank": 1, "signal": "SIGKILL"})
        assert (out["stand_in"], out["pid"]) == (shim, None)
        wait(lambda: gone(shim))
        table.refresh()
        assert row(table)["stand_in"]["state"] == "gone"


def test_a_rank_started_by_torchrun_itself_has_no_stand_in():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with RankTable() as table:
            table.update(record(proc.pid), sender_pid=proc.pid)
            assert row(table)["stand_in"] is None
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- detector


def robs(rank: int, state: str = "alive", **kw) -> RankObs:
    base = dict(
        node="n", job="job", rank=rank, world_size=2, pid=100 + rank, restart=3, state=state,
        step=50, phase="train", heartbeat_age_seconds=0.1, exited_at=None, step_seconds=0.1,
        compute_seconds=0.08, comm_seconds=0.02, comm_compute_ratio=0.25, loss=1.0,
        checkpoint_step=40, cpu_utilization=1.0,
    )  # fmt: skip
    base.update(kw)
    return RankObs(**base)


def cluster(*ranks: RankObs, now: float = 1000.0) -> ClusterObs:
    return ClusterObs(time=now, nodes=(NodeObs("n", "http://a", True, now, ranks=ranks),))


def stub(state: str, since: float) -> dict:
    return {"stand_in_pid": 555, "stand_in_state": state, "stand_in_since": since}


def test_a_stopped_stand_in_makes_its_rank_the_culprit_after_the_stop_budget():
    cfg = DetectorConfig(process_hang=ProcessHangConfig(stopped_seconds=2.0))
    obs = cluster(robs(0, **stub("alive", 900.0)), robs(1, **stub("stopped", 997.5)))
    (f,) = stand_in.detect(obs, History(), cfg)
    assert (f.kind, f.rank, f.node, f.key) == (RANK_HUNG, 1, "n", "rank_hung:job:3:stand_in:1")
    assert f.occurred_at == 997.5 and "pid 555" in f.summary
    assert f.evidence["stand_in_pid"] == 555 and f.evidence["node_url"] == "http://a"
    assert f.evidence["stacks_needed"] is False
    assert stand_in.detect(cluster(robs(1, **stub("stopped", 998.5))), History(), cfg) == []
    assert stand_in.detect(cluster(robs(1, **stub("gone", 900.0))), History(), cfg) == []
    assert stand_in.detect(cluster(robs(1)), History(), cfg) == []  # no stand-in at all


def test_a_finished_rank_with_a_stopped_stand_in_is_a_fault_too():
    obs = cluster(robs(0, "finished"), robs(1, "finished", **stub("stopped", 990.0)))
    (f,) = stand_in.detect(obs, History(), DetectorConfig())
    assert f.rank == 1 and f.evidence["rank_state"] == "finished"


def test_rank_obs_reads_the_stand_in_and_a_malformed_one_is_refused_by_the_contract():
    wire = RankAnswer(job="j", rank=1, local_rank=1, world_size=2, pid=7, restart=0,
                      state="alive").to_json()  # fmt: skip
    good = RankAnswer.from_json({**wire, "stand_in": {"pid": 9, "state": "stopped",
                                                       "state_since": 5.0}})  # fmt: skip
    r = RankObs.of("n", good)
    assert (r.stand_in_pid, r.stand_in_state, r.stand_in_since) == (9, "stopped", 5.0)
    assert RankObs.of("n", RankAnswer.from_json({**wire, "stand_in": None})).stand_in_pid is None
    for bad, field in (("x", "stand_in"), ({"pid": "9", "state": "alive", "state_since": 1.0},
                       "stand_in.pid"), ({"state": "stopped"}, "stand_in.pid")):  # fmt: skip
        with pytest.raises(ContractError) as err:
            RankAnswer.from_json({**wire, "stand_in": bad})
        assert err.value.field == field
