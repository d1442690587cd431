"""Rank table, process watching, telemetry receiver and the ranks collector.

Real sockets, real sender, real child processes and signals; fake /proc only to fake a
recycled PID (which cannot be produced on demand).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import telemetry_fields
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankguard.agent.collectors import CollectorContext
from rankguard.agent.collectors.ranks import RanksCollector
from rankguard.agent.ranks import (
    ProcessWatcher,
    RankLookupError,
    RankTable,
    RankTableFullError,
    parse_proc_stat,
    read_proc_stat,
)
from rankguard.agent.receiver import (
    BATCH_MIN_QLEN,
    BATCH_WAIT,
    RECEIVER_REASONS,
    Pacer,
    SocketInUseError,
    TelemetryReceiver,
    batch_wait,
)
from rankguard.client import Reporter, TelemetrySender
from rankguard.contract.states import RANK_STATES
from rankguard.contract.telemetry import PHASES, REASONS, TelemetryRecord, encode

# --------------------------------------------------------------------------- helpers


def rec(**overrides) -> TelemetryRecord:
    return TelemetryRecord(**telemetry_fields(**overrides))


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.005):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def rank_of(table: RankTable, job: str = "llama", rank: int = 0) -> dict | None:
    return next((r for r in table.snapshot() if (r["job"], r["rank"]) == (job, rank)), None)


CHILD = """
import json, os, sys, time
from rankguard.contract.telemetry import TelemetryRecord
from rankguard.client import TelemetrySender
f = json.loads(sys.argv[2]); f["pid"] = os.getpid(); f["time"] = time.time()
assert TelemetrySender(sys.argv[1]).send(TelemetryRecord(**f))
time.sleep(float(sys.argv[3]))
"""


def spawn_rank(path: Path, sleep: float = 30.0, **overrides) -> subprocess.Popen:
    """A real process that sends one valid record with its own pid, then sleeps."""
    record = json.dumps(telemetry_fields(**overrides))
    args = [sys.executable, "-c", CHILD, str(path), record, str(sleep)]
    return subprocess.Popen(args)


@pytest.fixture
def table():
    t = RankTable()
    yield t
    t.close()


@pytest.fixture
def sock_path(tmp_path) -> Path:
    return tmp_path / "run" / "telemetry.sock"


@pytest.fixture
def receiver(sock_path, table):
    r = TelemetryReceiver(sock_path, table)
    yield r
    r.close()


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def raw(sock_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: never drops
    yield lambda data: s.sendto(data, str(sock_path))
    s.close()


def handled(receiver: TelemetryReceiver) -> int:
    s = receiver.stats()
    return s["accepted"] + s["rejected_total"]


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# --------------------------------------------------------------------------- receiving


def test_real_sender_registers_rank(table, receiver, sock_path):
    sender = TelemetrySender(str(sock_path))
    assert sender.send(rec(rank=1, local_rank=1))
    wait_for(lambda: receiver.stats()["accepted"] == 1)
    r = rank_of(table, rank=1)
    assert (r["pid"], r["state"], r["up"], r["step"]) == (os.getpid(), "alive", True, 10)
    [now_view] = table.snapshot(time.time())  # the table's clock is Unix time by default
    assert 0 <= now_view["heartbeat_age_seconds"] < 5
    assert now_view["last_heartbeat_at"] == pytest.approx(time.time(), abs=5)
    assert table.processes() == [("llama", 1, os.getpid())]
    st_ = os.stat(sock_path)
    assert stat.S_ISSOCK(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o660
    sender.close()


def test_hostile_datagrams_are_counted_and_dropped(table, receiver, raw):
    valid = encode(rec())
    doc = json.loads(valid)
    bad = {
        "not_json": b"{not json",
        "truncated": valid[:-7],
        "too_large": b"x" * 70_000,
        "wrong_version": json.dumps({**doc, "v": 2}).encode(),
        "not_utf8": b"\xff\xfe" + valid,
        "not_object": b"[1, 2]",
        "missing_field": b"{}",
        "out_of_range": json.dumps({**doc, "mfu": 3.0}).encode(),
        "pid_mismatch": encode(rec(pid=1)),
    }
    for data in bad.values():
        raw(data)
    wait_for(lambda: handled(receiver) == len(bad))
    rejected = receiver.stats()["rejected"]
    expected = dict.fromkeys(RECEIVER_REASONS, 0)
    expected["not_json"] = 2  # the truncated record is no longer JSON
    for reason in ("too_large", "wrong_version", "not_utf8", "not_object", "missing_field"):
        expected[reason] = 1
    expected["out_of_range"] = expected["pid_mismatch"] = 1
    assert rejected == expected
    assert table.snapshot() == []  # nothing registered, pid 1 least of all
    last = receiver.stats()["last_error"]
    assert "pid 1" in last["pid_mismatch"] and str(os.getpid()) in last["pid_mismatch"]
    assert "mfu" in last["out_of_range"]


def test_pid_1_claim_is_refused(table, receiver, raw):
    raw(encode(rec(pid=1, rank=3, local_rank=3)))
    wait_for(lambda: handled(receiver) == 1)
    assert receiver.stats()["rejected"]["pid_mismatch"] == 1
    assert table.snapshot() == [] and table.processes() == []
    with pytest.raises(RankLookupError):
        table.verified_pid("llama", 3)


def test_datagram_without_credentials(table, receiver):
    assert receiver.handle(encode(rec()), None) == "no_credentials"
    assert receiver.handle(b"x", os.getpid(), truncated=True) == "too_large"
    assert table.snapshot() == []


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_mutated_records = st.tuples(st.sampled_from(sorted(telemetry_fields())), _json_values).map(
    lambda kv: json.dumps({**telemetry_fields(), kv[0]: kv[1]}).encode()
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=6000) | _mutated_records)
def test_garbage_never_kills_the_receiver(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "t.sock"
    with RankTable() as table, TelemetryReceiver(path, table) as receiver:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(encode(rec(step=7)), str(path))
        s.sendto(data, str(path))
        s.sendto(b"\x00garbage", str(path))
        wait_for(lambda: handled(receiver) == 3)
        s.close()
        stats = receiver.stats()
        assert stats["rejected"]["internal_error"] == 0
        assert set(stats["rejected"]) == set(RECEIVER_REASONS)
        assert stats["rejected"]["not_utf8"] + stats["rejected"]["not_json"] >= 1
        r = rank_of(table)
        assert r is not None and r["state"] == "alive"  # the valid state survived
        assert sum(x["records_received"] for x in table.snapshot()) == stats["accepted"]
        assert receiver._thread.is_alive()


def test_socket_file_rules(tmp_path, table):
    regular = tmp_path / "regular.sock"
    regular.write_text("precious")
    with pytest.raises(FileExistsError, match="not a socket"):
        TelemetryReceiver(regular, table)
    assert regular.read_text() == "precious"

    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens: stale
    with TelemetryReceiver(stale, table, mode=0o600) as r:
        assert stat.S_IMODE(os.stat(stale).st_mode) == 0o600
        with pytest.raises(SocketInUseError):
            TelemetryReceiver(stale, table)  # a live receiver is never removed
        assert r._thread.is_alive()
    assert not stale.exists()  # close() unlinks its socket


# --------------------------------------------------------------------------- processes


def test_sigkill_is_known_at_once(table, receiver, sock_path, children):
    """The pidfd wakes the table on the exit itself (no poll): well under 100 ms on an idle
    machine; the bound leaves room for a loaded one."""
    events = []
    table.subscribe(events.append)
    child = spawn_rank(sock_path, checkpoint_step=8)
    children.append(child)
    wait_for(lambda: rank_of(table) and events)  # its "alive" event too (see below)
    assert table.verified_pid("llama", 0) == child.pid

    t0 = time.monotonic()
    child.kill()
    r = wait_for(lambda: (x := rank_of(table)) and not x["up"] and x, interval=0.005)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, f"exit noticed after {elapsed * 1000:.1f} ms"
    # Not reaped yet (we have not waited): a zombie, which is dead.
    assert r["state"] == "zombie" and r["exited_at"] is not None
    assert f"parent (pid {os.getpid()})" in r["state_detail"]
    with pytest.raises(RankLookupError, match="zombie"):
        table.verified_pid("llama", 0)
    assert table.processes() == []

    child.wait()  # reaped: the next refresh says exited, keeping the exit time
    table.refresh()
    after = rank_of(table)
    assert after["state"] == "exited" and after["exited_at"] == r["exited_at"]
    assert [(e.previous, e.state) for e in events] == [
        (None, "alive"),
        ("alive", "zombie"),
        ("zombie", "exited"),
    ]
    # its last step and newest checkpoint ride along (supervisor/events.py)
    assert [(e.step, e.checkpoint_step) for e in events[1:]] == [(10, 8), (10, 8)]


def test_stop_and_continue(table, receiver, sock_path, children):
    events = []
    table.subscribe(events.append)
    child = spawn_rank(sock_path)
    children.append(child)
    # The receiver's thread inserts the rank under the table's lock and calls subscribers
    # after releasing it: a refresh on this thread can report "stopped" before that "alive"
    # is delivered (seen once in a full suite), so wait for it.
    wait_for(lambda: rank_of(table) and events)

    def state_after_refresh():
        table.refresh()
        return rank_of(table)["state"]

    os.kill(child.pid, signal.SIGSTOP)
    wait_for(lambda: state_after_refresh() == "stopped")
    r = rank_of(table)
    assert r["up"] and "SIGSTOP" in r["state_detail"]
    assert table.verified_pid("llama", 0) == child.pid  # stopped is alive: dumpable
    os.kill(child.pid, signal.SIGCONT)
    wait_for(lambda: state_after_refresh() == "alive")
    assert [e.state for e in events] == ["alive", "stopped", "alive"]
    assert rank_of(table)["cpu_seconds"] > 0


def test_finished_rank(table, receiver, sock_path, children):
    child = spawn_rank(sock_path, sleep=0, phase="done", step_seconds=0.0)
    children.append(child)
    child.wait()
    r = wait_for(lambda: (x := rank_of(table)) and x["state"] == "finished" and x)
    assert not r["up"] and r["step_seconds"] is None


def test_poll_fallback_watcher(children):
    exits = []
    watcher = ProcessWatcher(lambda pid, when: exits.append(pid), use_pidfd=False)
    try:
        assert watcher.mode == "poll"
        child = subprocess.Popen(["sleep", "30"])
        children.append(child)
        assert watcher.watch(child.pid, read_proc_stat(child.pid).start_ticks)
        child.kill()
        wait_for(lambda: exits == [child.pid], timeout=2)
        assert watcher.watching() == set()
    finally:
        watcher.close()


def test_verified_pid_refuses_recycled_pid(tmp_path, children):
    """A fake /proc lets the 'same' PID show another start time."""
    child = subprocess.Popen(["sleep", "30"])
    children.append(child)
    real = (Path("/proc") / str(child.pid) / "stat").read_text()
    stat_file = tmp_path / str(child.pid) / "stat"
    stat_file.parent.mkdir()
    stat_file.write_text(real)
    with RankTable(proc_root=tmp_path) as table:
        table.update(rec(pid=child.pid), child.pid)
        assert table.verified_pid("llama", 0) == child.pid
        parts = real.rsplit(")", 1)[1].split()
        parts[19] = str(int(parts[19]) + 1)  # starttime: another process now
        stat_file.write_text(real.rsplit(")", 1)[0] + ") " + " ".join(parts))
        with pytest.raises(RankLookupError, match="another process"):
            table.verified_pid("llama", 0)
        with pytest.raises(RankLookupError, match="no rank"):
            table.verified_pid("llama", 5)
        with pytest.raises(RankLookupError, match="no rank"):
            table.verified_pid("other", 0)


def test_restart_replaces_process_and_keeps_history(table, children):
    # torchrun's restart: a new worker of the same launcher (here: this test process)
    first = subprocess.Popen(["sleep", "30"])
    child = subprocess.Popen(["sleep", "30"])
    children.extend([first, child])
    table.update(rec(pid=first.pid, step=5), first.pid)
    table.update(rec(pid=child.pid, restart=1, step=6), child.pid)
    r = rank_of(table)
    assert (r["pid"], r["restart"], r["process_changes"], r["records_received"]) == (
        child.pid, 1, 1, 2,
    )  # fmt: skip
    assert [(e["pid"], e["restart"], e["step"]) for e in r["recent"]] == [
        (first.pid, 0, 5),
        (child.pid, 1, 6),
    ]
    assert table.verified_pid("llama", 0) == child.pid
    child.kill()  # the new process is the one watched
    wait_for(lambda: not rank_of(table)["up"])


def test_record_pid_must_be_sender_pid(table):
    with pytest.raises(ValueError, match="sender"):
        table.update(rec(pid=1), os.getpid())
    assert table.snapshot() == []


SPINNER = """
import json, os, sys, threading, time
from rankguard.contract.telemetry import TelemetryRecord
from rankguard.client import TelemetrySender
f = json.loads(sys.argv[2]); f["pid"] = os.getpid(); f["time"] = time.time()
assert TelemetrySender(sys.argv[1]).send(TelemetryRecord(**f))
def spin():
    while True:
        pass
if sys.argv[3] == "thread":  # another thread polls (NCCL's proxy), the main one sleeps
    threading.Thread(target=spin, daemon=True).start()
    time.sleep(60)
spin()
"""


def test_the_main_threads_own_state_is_told_apart_from_the_process_cpu(
    table, receiver, sock_path, children
):
    """On NCCL a rank's other threads poll while its main thread waits: the process's CPU
    says busy either way, the main thread's own run time, state and syscall do not."""
    for rank, where in ((0, "thread"), (1, "main")):
        args = [sys.executable, "-c", SPINNER, str(sock_path),
                json.dumps(telemetry_fields(rank=rank, local_rank=rank)), where]  # fmt: skip
        children.append(subprocess.Popen(args))
    wait_for(lambda: rank_of(table, rank=0) and rank_of(table, rank=1))
    table.refresh()
    time.sleep(table.cpu_window * 1.5)
    table.refresh()
    waiting, working = rank_of(table, rank=0), rank_of(table, rank=1)
    assert waiting["cpu_utilization"] > 0.2 and working["cpu_utilization"] > 0.2
    main = waiting["main_thread"]
    assert main["utilization"] < 0.05 and main["state"] == "S"
    assert main["syscall"].isdigit() and main["wchan"]  # asleep in clock_nanosleep
    busy = working["main_thread"]
    assert busy["utilization"] > 0.2 and busy["state"] == "R" and busy["syscall"] == "running"
    assert busy["run_seconds"] > main["run_seconds"] and busy["active_at"] > main["active_at"]


# --------------------------------------------------------------------------- table


def test_forget_after(children):
    with RankTable(forget_after=10.0) as table:
        gone = dead_pid()
        table.update(rec(pid=gone, rank=1, local_rank=1), gone, now=100.0)
        table.update(rec(), os.getpid(), now=100.0)
        r = rank_of(table, rank=1)
        assert r["state"] == "exited" and r["state_detail"] == "exited before it was watched"
        table.refresh(now=105.0)
        assert rank_of(table, rank=1) is not None
        table.refresh(now=110.5)
        assert rank_of(table, rank=1) is None
        assert rank_of(table, rank=0) is not None  # live ranks are never forgotten
        assert table.stats()["forgotten"] == 1


def test_rank_cap(tmp_path):
    with RankTable(max_ranks=2) as table, TelemetryReceiver(tmp_path / "t.sock", table) as rcv:
        table.update(rec(rank=0), os.getpid())
        table.update(rec(rank=1, local_rank=1), os.getpid())
        with pytest.raises(RankTableFullError, match="full"):
            table.update(rec(rank=2, local_rank=2), os.getpid())
        assert rcv.handle(encode(rec(rank=3, local_rank=3)), os.getpid()) == "table_full"
        assert rcv.stats()["rejected"]["table_full"] == 1
        assert table.stats()["refused"] == 2
        table.update(rec(rank=0, step=11), os.getpid())  # known ranks still update
        assert [r["rank"] for r in table.snapshot()] == [0, 1]

    with RankTable(max_ranks=1) as table:  # a dead rank makes room
        gone = dead_pid()
        table.update(rec(pid=gone), gone)
        table.update(rec(rank=2, local_rank=2), os.getpid())
        assert [r["rank"] for r in table.snapshot()] == [2]
        assert table.stats()["evicted"] == 1


def test_snapshot_json(table):
    table.update(rec(step=1, loss=math.nan), os.getpid(), now=50.0)
    for step in range(2, 80):
        table.update(rec(step=step, step_seconds=1.0 + step), os.getpid(), now=50.0 + step)
    table.update(rec(step=80, phase="checkpoint_save", step_seconds=0.0, loss=-math.inf),
                 os.getpid(), now=200.0)  # fmt: skip
    [r] = table.snapshot(now=203.5)
    json.dumps(r, allow_nan=False)  # strictly valid JSON
    assert r["loss"] == "-Infinity" and r["phase"] == "checkpoint_save"
    assert r["heartbeat_age_seconds"] == pytest.approx(3.5)
    # The heartbeat has no timings: the split is the last timed step's.
    assert (r["timed_step"], r["step_seconds"], r["compute_seconds"]) == (79, 80.0, 1.2)
    assert r["comm_compute_ratio"] == pytest.approx(0.5 / 1.2)
    assert r["records_received"] == 80
    assert len(r["recent"]) == 64 and r["recent"][-1]["step"] == 79
    assert r["recent"][0]["step"] == 79 - 63
    assert set(r["recent"][0]) == {
        "step", "phase", "restart", "pid", "step_seconds", "data_wait_seconds",
        "compute_seconds", "comm_seconds", "loss",
    }  # fmt: skip
    assert table.snapshot(recent=0)[0]["recent"] == []


def test_a_non_finite_loss_is_shown_in_its_wire_spelling(table):
    for step, loss in enumerate((math.nan, math.inf, -math.inf, 1.5)):
        table.update(rec(step=step, loss=loss), os.getpid())
        assert rank_of(table)["loss"] == {math.inf: "Infinity", -math.inf: "-Infinity"}.get(
            loss, "NaN" if math.isnan(loss) else loss
        )
    assert [s["loss"] for s in rank_of(table)["recent"]] == ["NaN", "Infinity", "-Infinity", 1.5]


def test_subscriber_errors_do_not_propagate(table):
    seen = []

    def broken(event):
        raise RuntimeError("boom")

    table.subscribe(broken)
    unsubscribe = table.subscribe(seen.append)
    table.update(rec(), os.getpid())
    assert [e.state for e in seen] == ["alive"]
    unsubscribe()
    table.update(rec(rank=1, local_rank=1), os.getpid())
    assert len(seen) == 1


def test_parse_proc_stat():
    line = "4242 (py (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 150 50 0 0 20 0 3 0 98765 0 0"
    ps = parse_proc_stat(line)
    assert (ps.state, ps.ppid, ps.start_ticks) == ("S", 1, 98765)
    assert ps.cpu_seconds == pytest.approx(200 / os.sysconf("SC_CLK_TCK"))
    with pytest.raises(ValueError):
        parse_proc_stat("garbage")


# --------------------------------------------------------------------------- client counters


def test_the_clients_failures_reach_the_agent(table, receiver, sock_path):
    """Records a rank could not send while the agent was away, and a wrong call it
    refused, are counted by the client and carried by its next record that arrives: the
    agent shows them per rank in /v1/ranks and as rankguard_client_errors_total."""
    receiver.close()  # no agent listening: the client drops its records, and counts them
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "RANKGUARD_JOB": "llama"}
    rg = Reporter(socket_path=str(sock_path), environ=env)  # its first record: a heartbeat
    with rg.step(1) as s:
        s.loss("not a number")  # counted as bad_value, the step goes on
    rg.flush()
    dropped = rg.sender.dropped_by_reason
    assert sum(dropped.values()) >= 2 and rg.errors == {"bad_value": 1}
    with TelemetryReceiver(sock_path, table) as back:  # the agent is back
        rg.heartbeat()
        wait_for(lambda: back.stats()["accepted"] == 1)
        expected = {"bad_value": 1, **{f"dropped_{r}": n for r, n in dropped.items()}}
        assert rank_of(table)["client_errors"] == expected
        res = RanksCollector(CollectorContext(), table=table, receiver=back).collect()
    counted = samples(res, "rankguard_client_errors_total")
    assert counted == {("llama", "0", reason): float(n) for reason, n in expected.items()}
    rg.sender.close()


def test_a_rank_without_client_errors_shows_none(table):
    table.update(rec(), os.getpid())
    assert rank_of(table)["client_errors"] == {}
    res = RanksCollector(CollectorContext(), table=table).collect()
    assert samples(res, "rankguard_client_errors_total") == {}


# --------------------------------------------------------------------------- collector


def test_counters_for_rates(table):
    """Steps, tokens, step time (histogram), phase time and FLOPs add up over every timed
    step; heartbeats add nothing; peak FLOP/s is a gauge."""
    table.update(rec(step_seconds=0.04, tokens_per_second=1000.0, flops=6e9), os.getpid())
    table.update(rec(step_seconds=2.0, tokens_per_second=500.0, flops=4e9, peak_flops=1e12),
                 os.getpid())  # fmt: skip
    table.update(rec(phase="checkpoint_save", step_seconds=0.0, data_wait_seconds=0.0,
                     compute_seconds=0.0, comm_seconds=0.0, comm_exposed_seconds=0.0,
                     optimizer_seconds=0.0), os.getpid())  # heartbeat  # fmt: skip
    table.update(rec(rank=1, local_rank=1, step_seconds=0.3), os.getpid())  # no flops sent
    res = RanksCollector(CollectorContext(), table=table).collect()
    key = ("llama", "0")
    assert samples(res, "rankguard_rank_steps_total") == {key: 2, ("llama", "1"): 1}
    assert samples(res, "rankguard_rank_tokens_total")[key] == pytest.approx(40 + 1000)
    assert samples(res, "rankguard_rank_flops_total") == {key: 1e10}  # rank 1 sent none
    assert samples(res, "rankguard_rank_peak_flops") == {key: 1e12}
    phase = samples(res, "rankguard_rank_step_phase_seconds_total")
    assert phase[(*key, "compute")] == pytest.approx(2.4) and phase[(*key, "comm")] == 1.0
    hist = next(m for m in res.metrics if m.name == "rankguard_rank_step_seconds")
    assert hist.kind == "histogram"
    (labels, buckets, total), *_ = hist.buckets
    cumulative = dict(buckets)
    assert labels == key and total == pytest.approx(2.04)
    assert cumulative["0.025"] == 0 and cumulative["0.05"] == 1 and cumulative["1.0"] == 1
    assert cumulative["2.5"] == 2 and cumulative["+Inf"] == 2
    assert list(cumulative.values()) == sorted(cumulative.values())  # cumulative


def samples(result, name):
    metric = next(m for m in result.metrics if m.name == name)
    return {labels: value for labels, value in metric.samples}


def test_collector_metrics(table, receiver, tmp_path):
    me = str(os.getpid())
    table.update(rec(rank=0, loss=math.nan), os.getpid())
    table.update(rec(rank=1, local_rank=1, phase="eval", checkpoint_step=900), os.getpid())
    receiver.handle(b"junk", os.getpid())
    res = RanksCollector(CollectorContext(), table=table, receiver=receiver).collect()

    names = {m.name for m in res.metrics}
    assert all(n.startswith("rankguard_") for n in names)
    assert samples(res, "rankguard_rank_info") == {
        ("llama", "0", "0", "4", me): 1.0,
        ("llama", "1", "1", "4", me): 1.0,
    }
    assert samples(res, "rankguard_rank_up") == {("llama", "0"): 1.0, ("llama", "1"): 1.0}
    state = samples(res, "rankguard_rank_process_state")
    assert len(state) == 2 * len(RANK_STATES) and state[("llama", "0", "alive")] == 1.0
    assert state[("llama", "0", "exited")] == 0.0
    phase = samples(res, "rankguard_rank_phase")
    assert len(phase) == 2 * len(PHASES) and phase[("llama", "1", "eval")] == 1.0
    assert sum(phase.values()) == 2
    split = samples(res, "rankguard_rank_phase_seconds")
    assert split[("llama", "0", "compute")] == 1.2 and split[("llama", "0", "comm_exposed")] == 0.2
    assert {k[2] for k in split} == {
        "data_wait", "compute", "comm", "comm_exposed", "optimizer", "checkpoint_block",
    }  # fmt: skip
    assert samples(res, "rankguard_rank_comm_step_ratio")[("llama", "0")] == 0.25
    assert samples(res, "rankguard_rank_data_wait_ratio")[("llama", "0")] == 0.05
    assert samples(res, "rankguard_rank_comm_compute_ratio")[("llama", "0")] == pytest.approx(
        0.5 / 1.2
    )
    assert samples(res, "rankguard_rank_step")[("llama", "1")] == 10
    # last-step rates are counters now (test_counters_for_rates); no such gauges remain
    assert not names & {"rankguard_rank_tokens_per_second", "rankguard_rank_mfu_ratio"}
    assert samples(res, "rankguard_rank_steps_total")[("llama", "0")] == 1
    assert math.isnan(samples(res, "rankguard_rank_loss")[("llama", "0")])
    assert samples(res, "rankguard_rank_checkpoint_step") == {("llama", "1"): 900.0}
    assert samples(res, "rankguard_rank_peak_memory_bytes")[("llama", "0")] == 2**30
    assert samples(res, "rankguard_rank_restarts")[("llama", "0")] == 0
    assert samples(res, "rankguard_rank_heartbeat_age_seconds")[("llama", "0")] >= 0
    assert samples(res, "rankguard_rank_last_heartbeat_timestamp_seconds")[
        ("llama", "0")
    ] == pytest.approx(time.time(), abs=5)
    assert samples(res, "rankguard_rank_cpu_seconds_total")[("llama", "0")] > 0
    assert samples(res, "rankguard_ranks") == {
        ("alive",): 2, ("stopped",): 0, ("zombie",): 0, ("exited",): 0, ("finished",): 0,
    }  # fmt: skip
    assert samples(res, "rankguard_telemetry_records_total") == {(): 0.0}
    rejected = samples(res, "rankguard_telemetry_rejected_total")
    assert set(rejected) == {(r,) for r in RECEIVER_REASONS} and set(REASONS) < set(
        RECEIVER_REASONS
    )
    assert rejected[("not_json",)] == 1 and sum(rejected.values()) == 1
    assert res.facts["ranks"]["alive"] == 2 and res.facts["receiver"]["rejected_total"] == 1
    json.dumps(res.facts, allow_nan=False)


def test_collector_without_table():
    res = RanksCollector(CollectorContext()).collect()
    assert samples(res, "rankguard_rank_up") == {}
    assert samples(res, "rankguard_ranks")[("alive",)] == 0
    assert len(samples(res, "rankguard_telemetry_rejected_total")) == len(RECEIVER_REASONS)


# --------------------------------------------------------------------------- batching


def test_pacer_fills_half_the_kernel_queue_at_the_rate_seen():
    p = Pacer(10, max_wait=0.1)
    assert p.next_wait(1, 100.0) == (None, False)  # no rate yet: block, judge at once
    assert p.next_wait(8, 100.1) == (pytest.approx(0.0625), False)  # 80/s: 5 in 62.5 ms
    assert p.next_wait(3, 100.2) == (0.1, False)  # 30/s: 3 gather in 0.1 s, the most
    wait, full = p.next_wait(10, 100.3)  # at the cap: senders may have dropped
    assert full and wait == pytest.approx(0.05)
    assert p.next_wait(12, 100.31) == (pytest.approx(0.025), True)
    assert p.next_wait(0, 100.4) == (None, False)  # empty: block until one arrives
    assert p.next_wait(1, 101.4) == (None, False)  # 1/s: nothing would gather, block
    assert p.next_wait(12, 101.41) == (None, True)  # a burst while blocked: still block
    always = Pacer(10, max_wait=0.1, min_batch=0)
    assert always.next_wait(1, 100.0) == (0.1, False)  # no rate yet: the longest wait
    with pytest.raises(ValueError):
        Pacer(0)
    # a long queue: the wait aims at max_batch datagrams, not half of 512
    long = Pacer(512, max_wait=0.5, max_batch=128)
    long.next_wait(10, 200.0)
    assert long.next_wait(400, 200.5) == (pytest.approx(0.16), False)  # 800/s: 128
    assert long.next_wait(80, 201.5) == (0.5, False)  # 80/s: 40 in the longest wait


def test_batching_is_on_by_itself_only_where_the_kernel_queue_is_long():
    assert batch_wait(None, 10) == 0.0  # the kernel's default: a wait would drop bursts
    assert batch_wait(None, BATCH_MIN_QLEN) == batch_wait(None, 512) == BATCH_WAIT
    assert batch_wait(0.0, 512) == 0.0 and batch_wait(0.02, 10) == 0.02  # as configured


def test_receiver_gathers_datagrams_per_wakeup(table, sock_path, raw):
    """40 records at about 200/s: judged in batches, not one wake-up per datagram (the
    old receiver woke 40 times). The blocking sender never drops, so all 40 arrive."""
    with TelemetryReceiver(sock_path, table, max_wait=0.1) as r:  # opt-in batching
        for i in range(40):
            raw(encode(rec(step=i + 1)))
            time.sleep(0.005)
        wait_for(lambda: r.stats()["accepted"] == 40)
        print(f"wake-ups for 40 records: {r.wakeups}")
        assert r.wakeups <= 20
        assert rank_of(table)["step"] == 40


def test_a_record_that_waited_for_a_drain_is_dated_when_it_arrived(table, sock_path, raw):
    """The kernel's receive timestamp dates a record, not the drain: a rank's heartbeat
    age does not shrink by the time its last record waited in the queue."""
    with TelemetryReceiver(sock_path, table, max_wait=30) as r:
        r.pacer.min_batch = 0  # wait after every drain, the first one too
        raw(encode(rec(job="prime")))
        wait_for(lambda: r.stats()["accepted"] == 1)  # now waiting up to 30 s
        raw(encode(rec(step=5)))
        time.sleep(0.6)
        assert r.flush() == 1
        age = rank_of(table)["heartbeat_age_seconds"]
        assert 0.5 <= age < 10, age


def test_an_exit_first_drains_what_the_process_sent(table, sock_path, raw, children):
    """The receiver is in a long wait, and a known rank sends "done" then exits: the exit
    drains the socket first, so the rank is finished at once and never exited in between."""
    events = []
    table.subscribe(events.append)
    child_code = CHILD.replace(
        "assert TelemetrySender(sys.argv[1]).send(TelemetryRecord(**f))",
        "s = TelemetrySender(sys.argv[1]); assert s.send(TelemetryRecord(**f)); print(1, flush=True)"
        "; sys.stdin.readline(); f['phase'] = 'done'; f['step_seconds'] = 0.0"
        "; assert s.send(TelemetryRecord(**f))",
    )
    with TelemetryReceiver(sock_path, table, max_wait=30) as r:
        r.pacer.min_batch = 0  # wait after every drain, the first one too
        raw(encode(rec(job="prime")))
        wait_for(lambda: r.stats()["accepted"] == 1)  # now waiting up to 30 s
        record = json.dumps(telemetry_fields())
        args = [sys.executable, "-c", child_code, str(sock_path), record, "0"]
        child = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout.readline().strip() == "1"
        assert r.flush() == 1 and rank_of(table)["up"]  # a reader's flush() takes it now
        child.stdin.write("go\n")
        child.stdin.flush()
        x = wait_for(lambda: (x := rank_of(table)) and not x["up"] and x)
        assert x["state"] == "finished"
        assert [e.state for e in events if e.job == "llama"] == ["alive", "finished"]
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2  # close() cuts the long wait short
