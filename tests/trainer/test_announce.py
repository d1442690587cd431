"""The worker's start-up announcement (trainer/announce.py), the load-delay fault and the
client's progress-gated beats: real sockets and files, no torch, no subprocesses."""

from __future__ import annotations

import os
import socket
import time

import pytest

from rankguard.client.checkpoint_store import claim_incarnation
from rankguard.client.reporter import ProcessProgress, Reporter
from rankguard.contract.telemetry import decode
from rankguard.trainer import announce
from rankguard.trainer.faults import FaultInjector, parse_fault_specs


@pytest.fixture
def sink(tmp_path):
    path = tmp_path / "t.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(3)
    yield path, s
    s.close()


def test_the_guessed_incarnation_is_what_rank_0_then_claims(tmp_path):
    assert announce.guess_incarnation(None, 3) == 3
    assert announce.guess_incarnation(tmp_path, 0) == 0  # a first start
    for restart_count in (0, 0, 5, 1):
        guess = announce.guess_incarnation(tmp_path, restart_count)
        assert claim_incarnation(tmp_path, at_least=restart_count) == guess
    (tmp_path / "incarnation").write_text("junk\n")
    assert announce.guess_incarnation(tmp_path, 2) == 2


def test_announce_sends_one_init_record_then_stops(sink, tmp_path, monkeypatch):
    path, s = sink
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "incarnation").write_text("4\n")
    monkeypatch.setattr(announce, "_state", {})
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2"}
    announce.announce(["--job", "jobx", "--telemetry-socket", str(path),
                       "--ckpt-dir", str(tmp_path / "ckpt")], env)  # fmt: skip
    record = decode(s.recv(4096))
    assert (record.job, record.rank, record.world_size, record.phase) == ("jobx", 1, 2, "init")
    assert (record.restart, record.pid, record.step) == (4, os.getpid(), 0)
    announce.announce(["--job", "jobx"], env)  # once per process
    announce.stop()
    # a bad command line announces nothing (main reports it)
    monkeypatch.setattr(announce, "_state", {})
    announce.announce(["--steps", "x", "--telemetry-socket", str(path)], env)
    with pytest.raises(TimeoutError):
        s.settimeout(0.3)
        s.recv(4096)


def test_load_delay_and_the_longest_ckpt_delay(monkeypatch):
    specs = parse_fault_specs(["load-delay:step=10:rank=0:seconds=0.2:restart=any",
                               "ckpt-delay:step=0:seconds=1.5"])  # fmt: skip
    f = FaultInjector(specs, rank=0, restart_count=3)
    slept: list[float] = []
    monkeypatch.setattr("rankguard.trainer.faults.time.sleep", slept.append)
    f.load_delay(None)
    f.load_delay(5)  # a checkpoint before step 10: no delay
    assert slept == []
    f.load_delay(10)
    assert slept == [0.2]
    f = FaultInjector(specs, rank=0, restart_count=0)
    f.specs.append(parse_fault_specs(["ckpt-delay:step=0:seconds=3000"])[0])
    assert f.ckpt_delay(20) == 3000  # a stuck save over a slow one


def test_progress_beats_only_while_the_process_moves(sink):
    path, s = sink
    rg = Reporter(socket_path=str(path), heartbeat_seconds=0.1, heartbeat_progress=True,
                  environ={})  # fmt: skip
    s.recv(4096)  # the reporter's first heartbeat
    with rg.phase("checkpoint_load"):
        s.recv(4096)  # announced
        time.sleep(0.5)  # asleep: no beats
        s.settimeout(0.05)
        with pytest.raises(TimeoutError):
            s.recv(4096)
        end = time.monotonic() + 0.4
        x = 0
        while time.monotonic() < end:  # busy: beats
            x += 1
        s.settimeout(1)
        assert decode(s.recv(4096)).phase == "checkpoint_load"
    rg.sender.close()
    assert isinstance(ProcessProgress().moved(), bool)
