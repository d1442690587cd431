"""The rank's flight-recorder wavefront (client/flight_recorder.py) and the Reporter's stall
watch that sends it (client/reporter.py).

Parsing on literal dumps (as torch 2.13 writes them on gloo), garbage included; enable()
never overriding the user; and a real 2-rank gloo torchrun that hangs as real jobs do
(rank 1 one all-reduce ahead and blocked in it, rank 0 stuck in its own code): a thread
reads each rank's wavefront while rank 1 is blocked, and each rank's Reporter sends its
wavefront as evidence (``progress`` false) on a real socket within about 2 s of the stall,
and none while the steps flowed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import run_in_own_session

from rankguard.client import Reporter
from rankguard.client import flight_recorder as fr
from rankguard.contract.telemetry import (
    MAX_COLLECTIVES,
    MAX_DATAGRAM_BYTES,
    Collective,
    TelemetryError,
    TelemetryRecord,
    decode,
    encode,
)

JOB = Path(__file__).with_name("flight_recorder_job.py")


def entry(pg_id, seq, name="gloo:all_reduce", sizes=((4,),), group=None, **kw):
    e = {
        "record_id": seq, "pg_id": pg_id, "process_group": group or [str(pg_id), "default_pg"],
        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": name,
        "input_sizes": [list(s) for s in sizes], "state": "scheduled", "is_p2p": False,
        "timeout_ms": 1800000, "retired": True,
    }  # fmt: skip
    e.update(kw)
    return e


def status(enqueued, completed):
    return {
        "last_enqueued_collective": str(enqueued),
        "last_completed_collective": str(completed),
        "last_started_collective": "-1",
    }


# What torch 2.13 dumped on gloo for rank 1 of flight_recorder_job.py's hang (trimmed):
# the default group one all-reduce ahead, a sub-group with its own sequence.
RANK1 = {
    "version": "2.10",
    "comm_lib_version": "",
    "nccl_comm_state": {},
    "pg_config": {"": {"desc": "", "name": "", "ranks": "[]"}},
    "pg_status": {"0": status(3, 2), "1": status(1, 1)},
    "entries": [
        entry(0, 1),
        entry(1, 1, group=["1", "undefined"]),
        entry(0, 2),
        entry(0, 3, sizes=((2, 3),)),
    ],
}


def test_a_dump_gives_each_groups_place_in_its_sequence():
    assert fr.wavefront(RANK1) == (
        Collective("0", "default_pg", 3, 2, "gloo:all_reduce", "[[2,3]]", 1800.0),
        Collective("1", "undefined", 1, 1, "gloo:all_reduce", "[[4]]", 1800.0),
    )


def test_a_group_whose_entry_left_the_buffer_keeps_its_ids():
    dump = {"pg_status": {"0": status(5000, 4999), "7": status(2, 2)}, "entries": [entry(0, 4)]}
    assert fr.wavefront(dump) == (
        Collective("0", "default_pg", 5000, 4999),  # its name from an older entry
        Collective("7", "", 2, 2),  # no entry at all: its pg id names it
    )


def test_point_to_point_entries_are_not_the_collective():
    dump = {"pg_status": {"0": status(2, 2)},
            "entries": [entry(0, 2), entry(0, 2, name="gloo:send", is_p2p=True)]}  # fmt: skip
    assert fr.wavefront(dump)[0].op == "gloo:all_reduce"


def test_names_are_bounded_and_printable_and_shapes_cut():
    dump = {
        "pg_status": {"0": status(1, 0)},
        "entries": [entry(0, 1, name="x" * 100, sizes=[[1024] * 30],
                          group=["g\x1b[2J" + "n" * 100, "d\n" * 50])],
    }  # fmt: skip
    (c,) = fr.wavefront(dump)
    assert c.pg == "g?[2J" + "n" * 59 and len(c.pg) == 64
    assert len(c.desc) == 64 and c.desc.isprintable()
    assert c.op == "x" * 48 and len(c.shape) == 64 and c.shape.startswith("[[1024,1024")


def test_at_most_16_groups_the_busiest_first():
    dump = {"pg_status": {str(i): status(i, i) for i in range(40)}, "entries": []}
    front = fr.wavefront(dump)
    assert len(front) == MAX_COLLECTIVES
    assert [c.enqueued for c in front] == list(range(39, 23, -1))


@pytest.mark.parametrize(
    "dump",
    [
        None, [], "pg_status", 7, {}, {"pg_status": []}, {"pg_status": {"0": "2"}},
        {"pg_status": {"0": {"last_enqueued_collective": "two"}}},
        {"pg_status": {"0": {"last_enqueued_collective": "1"}}},  # no completed
        {"pg_status": {"0": status(2**70, 1)}},
        {"pg_status": {"0": status(-5, -1)}},
        {"pg_status": {"0": {"last_enqueued_collective": True,
                             "last_completed_collective": True}}},
    ],
)  # fmt: skip
def test_garbage_gives_nothing(dump):
    assert fr.wavefront(dump) == ()


def test_garbage_entries_leave_the_ids():
    for entries in ("x", [1, None, "e"], [{"pg_id": True}], [entry(0, 1, timeout_ms="soon",
                    input_sizes={"a": 1}, profiling_name=5, process_group="0")]):  # fmt: skip
        front = fr.wavefront({"pg_status": {"0": status(1, 1)}, "entries": entries})
        assert front == (Collective("0", "", 1, 1),), entries


def test_nccls_and_glooss_recorders_are_both_read_apart():
    """A cpu:gloo,cuda:nccl group is in both recorders, each counting its own sequence."""
    nccl = {"pg_status": {"0": status(90, 89)},
            "entries": [entry(0, 90, name="nccl:all_reduce")]}  # fmt: skip
    merged = fr._merged([nccl, RANK1])
    assert [(c.pg, c.enqueued, c.op) for c in merged] == [
        ("0", 90, "nccl:all_reduce"), ("0:gloo", 3, "gloo:all_reduce"),
        ("1", 1, "gloo:all_reduce"),
    ]  # fmt: skip


def test_enable_sets_the_size_and_never_the_users():
    env: dict[str, str] = {}
    assert fr.enable(env) is True
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000"}  # 2.13: the deprecated name warns
    env = {"TORCH_FR_BUFFER_SIZE": "500"}
    assert fr.enable(env, 10) is True and env == {"TORCH_FR_BUFFER_SIZE": "500"}
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}  # the user's "off", in the old name
    assert fr.enable(env) is False and env["TORCH_FR_BUFFER_SIZE"] == "0"
    assert fr.enable({"TORCH_FR_BUFFER_SIZE": "lots"}) is False
    env = {}
    fr.enable(env, dump_to="/run/x/flight-recorder/rank_")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/run/x/flight-recorder/rank_"


def test_enable_sets_the_old_names_for_a_torch_that_reads_only_them(monkeypatch):
    monkeypatch.setattr(fr, "_old_torch", lambda: True)
    env = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/r_"}
    assert fr.enable(env, 64, dump_to="/run/r_") is True
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_TRACE_BUFFER_SIZE": "64",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/r_", "TORCH_FR_DUMP_TEMP_FILE": "/mine/r_",
    }  # fmt: skip


def test_reading_never_raises(monkeypatch):
    assert fr.read_wavefront() == ()  # no process group in this process

    class Broken:
        def is_available(self):
            return True

        def is_initialized(self):
            raise RuntimeError("torch changed")

    monkeypatch.setitem(sys.modules, "torch.distributed", Broken())
    assert fr.read_wavefront() == ()


def test_a_wavefront_of_16_groups_fits_a_datagram():
    """16 groups as deep models name them fit whole beside a full record."""
    rg = Reporter(socket_path=None, heartbeat_seconds=0, flight_recorder=False)
    rg.errors.update({f"reason_{i}": 10**9 for i in range(10)})
    front = tuple(
        Collective(f"{i}", "mesh_dp_shard_cp_group", 10**9 + i, 10**9, "nccl:_reduce_scatter_base",
                   f"[[{2**24}],[{2**24}]]", 600.0)
        for i in range(16)
    )  # fmt: skip
    record = {"v": 1, "job": "j" * 128, "rank": 0, "local_rank": 0, "world_size": 1, "pid": 1,
              "restart": 0, "step": 10**9, "phase": "train", "time": time.time(),
              **dict.fromkeys(("step_seconds", "data_wait_seconds", "compute_seconds",
                               "comm_seconds", "comm_exposed_seconds", "optimizer_seconds",
                               "checkpoint_block_seconds", "tokens_per_second", "mfu"), 0.0),
              "peak_memory_bytes": 2**40, "loss": 1.5, "checkpoint_step": 10**9,
              "gpu_uuid": "GPU-6f3c2a1e-8b7d-4c5e-9f0a-1b2c3d4e5f60", "progress": False}  # fmt: skip
    fitted = rg._fitting(record, front)
    assert len(fitted) == 16
    counts = rg.sender._error_counts()
    full = {**record, "collectives": fitted, "client_errors": counts}
    assert len(encode(TelemetryRecord.from_dict(full))) <= MAX_DATAGRAM_BYTES - 64
    # the longest texts the contract takes: the busiest groups that fit are sent
    longest = tuple(Collective(f"{i:02d}" + "p" * 62, "d" * 64, 2**63 - 1 - i, 2**63 - 2,
                               "o" * 48, "s" * 64, 1e300) for i in range(16))  # fmt: skip
    fitted = rg._fitting(record, longest)
    assert 4 <= len(fitted) < 16 and fitted == [c.to_json() for c in longest[: len(fitted)]]
    rg.close()


# --------------------------------------------------------------------------- a real hang


def _receive(path: Path, into: list, stop: threading.Event) -> socket.socket:
    """A real agent-side socket, drained as datagrams arrive (the queue holds 10)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.05)

    def drain() -> None:
        while not stop.is_set():
            try:
                into.append(decode(sock.recv(MAX_DATAGRAM_BYTES + 1)))
            except TimeoutError:
                continue
            except (OSError, TelemetryError):
                return

    threading.Thread(target=drain, daemon=True).start()
    return sock


@pytest.fixture(scope="module")
def hang(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fr")
    path = out / "telemetry.sock"
    records: list = []
    stop = threading.Event()
    sock = _receive(path, records, stop)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in (*fr.BUFFER_ENVS, *fr.DUMP_FILE_ENVS):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(JOB), str(out), str(path)]  # fmt: skip
    returncode, output = run_in_own_session(cmd, env=env, cwd=out, timeout=180)
    time.sleep(0.2)
    stop.set()
    sock.close()
    assert returncode == 0, output[-6000:]
    assert "TRACE_BUFFER_SIZE is deprecated" not in output, output[-3000:]  # none of ours
    return {
        "records": records,
        "thread": {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)},
    }


def _by_pg(front) -> dict:
    return {c["pg"]: c for c in front}


@pytest.mark.slow
def test_a_thread_reads_the_wavefront_while_the_main_thread_is_blocked(hang):
    r0, r1 = (_by_pg(hang["thread"][r]) for r in (0, 1))
    assert r1["0"]["enqueued"] == r0["0"]["enqueued"] + 1  # rank 1 one collective ahead
    assert r1["0"]["completed"] == r0["0"]["completed"] == r0["0"]["enqueued"]
    assert r1["0"]["op"] == "gloo:all_reduce" and r1["0"]["shape"] == "[[2,3]]"
    assert r0["1"] == r1["1"] and r0["1"]["desc"] == "pair"  # the sub-group: in step


@pytest.mark.slow
def test_a_stalled_rank_sends_its_wavefront_as_evidence_and_none_while_steps_flow(hang):
    from flight_recorder_job import STEPS

    for rank in (0, 1):
        mine = [r for r in hang["records"] if r.rank == rank]
        evidence = [r for r in mine if not r.progress]
        assert evidence, [(r.step, r.phase, r.progress) for r in mine]
        # none while the steps flowed (one in "init", a slow start, may be)
        assert all(r.step in (0, STEPS) for r in evidence), [r.step for r in evidence]
        stall = [r for r in evidence if r.step == STEPS]
        assert stall and all(r.collectives and r.phase == "train" for r in stall)
        last_step = max(r.time for r in mine if r.progress and r.step == STEPS)
        assert stall[0].time - last_step < 2.5, stall[0].time - last_step
    front = {rank: next(r for r in hang["records"] if r.rank == rank and not r.progress
                        and r.step == STEPS).collectives for rank in (0, 1)}  # fmt: skip
    c0, c1 = ({c.pg: c for c in front[r]} for r in (0, 1))
    assert c1["0"].enqueued == c0["0"].enqueued + 1 == STEPS + 1
    assert c1["0"].completed == c0["0"].completed == STEPS


# --------------------------------------------------------------------------- the watch


@pytest.fixture
def agent_socket(tmp_path):
    """A socket standing in for the agent's, and the records it received."""
    records: list = []
    stop = threading.Event()
    sock = _receive(tmp_path / "t.sock", records, stop)
    yield tmp_path / "t.sock", records
    stop.set()
    sock.close()


def _watched(monkeypatch, path, statuses, fronts):
    """A Reporter whose recorder shows `statuses` one look after another (the last one
    then for good), with the wavefront `fronts[status]`; the watch's clocks shortened."""
    from rankguard.client import reporter

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    for name, seconds in (("STALL_LOOK_SECONDS", 0.05), ("STALL_READ_SECONDS", 0.3),
                          ("STALL_REPEAT_SECONDS", 0.5)):  # fmt: skip
        monkeypatch.setattr(reporter, name, seconds)
    looks = iter(statuses)
    current = [None]

    def read_status():
        current[0] = next(looks, statuses[-1])
        return current[0]

    monkeypatch.setattr(fr, "read_status", read_status)
    monkeypatch.setattr(fr, "read", lambda: (current[0], fronts[current[0]]))
    return Reporter(socket_path=str(path), heartbeat_seconds=0)


def _wait(records, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while len([r for r in records if not r.progress]) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return [r for r in records if not r.progress]


def test_the_watch_repeats_a_still_wavefront_and_sends_a_moved_one_once_it_holds(
    monkeypatch, agent_socket
):
    path, records = agent_socket
    f1, f2 = (Collective("0", "default_pg", 5, 4),), (Collective("0", "default_pg", 6, 5),)
    start = time.time()
    rg = _watched(monkeypatch, path, ["s1", "s1", "s1", "s2", "s2"], {"s1": f1, "s2": f2})
    evidence = _wait(records, 3)
    rg.close()
    # at once, again after the repeat interval, then the moved one once it held a look
    assert [r.collectives for r in evidence[:3]] == [f1, f1, f2]
    assert all(r.phase == "init" and r.step == 0 for r in evidence)
    assert evidence[0].time - start < 2.0  # a stall is 1 s without progress
    assert rg.errors == {}


def test_the_watch_counts_a_failing_recorder_and_training_goes_on(monkeypatch, agent_socket):
    path, records = agent_socket

    def broken():
        raise RuntimeError("torch changed")

    rg = _watched(monkeypatch, path, ["s"], {})
    monkeypatch.setattr(fr, "read_status", broken)
    time.sleep(1.8)
    with rg.step(1):  # training goes on, untouched
        pass
    rg.close()
    assert rg.errors.get("flight_recorder", 0) >= 1
    assert not [r for r in records if not r.progress]
    assert [r.step for r in records if r.phase == "train"] == [1]


def test_no_watch_without_the_flight_recorder_or_a_socket(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    names = lambda: {t.name for t in threading.enumerate()}  # noqa: E731
    before = names()
    for rg in (Reporter(socket_path=str(tmp_path / "none.sock"), flight_recorder=False),
               Reporter(socket_path=None)):  # fmt: skip
        assert "rankguard-wavefront" not in names() - before
        rg.close()
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # the user's "off"
    rg = Reporter(socket_path=str(tmp_path / "none.sock"))
    assert rg._watcher is None
    rg.close()
