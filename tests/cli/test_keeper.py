"""The rule `rankguard up` keeps its agent and supervisor running by (cli/keeper.py):
fake processes, a fake health check and a fake clock; and when `up` knows training is
over (the bound on waiting for torchrun afterwards)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rankguard.cli.keeper import KeptDaemon, describe_exit
from rankguard.cli.up import training_finished


class FakeProc:
    def __init__(self) -> None:
        self.returncode: int | None = None
        self.killed = False

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.killed = True
        self.returncode = -9

    def wait(self, timeout=None) -> int | None:
        return self.returncode


class Rig:
    def __init__(self, **kw) -> None:
        self.now = 100.0
        self.spawned: list[FakeProc] = []
        self.health = False
        self.daemon = KeptDaemon("supervisor", spawn=self.spawn, healthy=lambda: self.health,
                                 proc=FakeProc(), clock=lambda: self.now, **kw)  # fmt: skip

    def spawn(self) -> FakeProc:
        self.spawned.append(FakeProc())
        return self.spawned[-1]


def test_a_running_daemon_is_left_alone():
    rig = Rig()
    assert [rig.daemon.tick() for _ in range(3)] == [None] * 3
    assert rig.spawned == [] and rig.daemon.note() == ""


def test_a_dead_daemon_is_restarted_and_counted():
    rig = Rig()
    rig.daemon.proc.returncode = -9
    assert rig.daemon.tick() == "supervisor killed by SIGKILL; restarting it"
    assert rig.daemon.note() == "supervisor down (killed by SIGKILL)"
    assert rig.daemon.tick() is None and len(rig.spawned) == 1  # started at once
    assert rig.daemon.state == "starting" and rig.daemon.restarts == 1
    assert rig.daemon.tick() is None  # not healthy yet
    rig.health = True
    assert rig.daemon.tick() == "supervisor restarted (1 so far), serving again"
    assert rig.daemon.state == "up" and rig.daemon.proc is rig.spawned[0]
    assert rig.daemon.note() == "supervisor restarts 1"
    rig.spawned[0].returncode = 1  # and again
    assert rig.daemon.tick() == "supervisor exited 1; restarting it"
    rig.daemon.tick()
    assert rig.daemon.restarts == 2 and len(rig.spawned) == 2


def test_failed_starts_back_off_and_a_start_that_never_answers_is_killed():
    rig = Rig(start_timeout=10.0, backoff_base=1.0, backoff_max=4.0)
    rig.daemon.proc.returncode = -9
    rig.daemon.tick()
    rig.daemon.tick()
    rig.spawned[-1].returncode = 2  # the port is taken, say
    assert rig.daemon.tick() == "supervisor failed to start again (exited 2); next try in 1s"
    assert rig.daemon.tick() is None and len(rig.spawned) == 1  # waits for the backoff
    rig.now += 1.0
    rig.daemon.tick()
    assert len(rig.spawned) == 2
    rig.now += 10.0  # alive but never healthy
    assert rig.daemon.tick() == (
        "supervisor failed to start again (not healthy within 10s); next try in 2s"
    )
    assert rig.spawned[-1].killed
    for expected_wait in (4.0, 4.0):  # doubling, capped
        rig.now += 100.0
        rig.daemon.tick()
        rig.spawned[-1].returncode = 1
        assert rig.daemon.tick().endswith(f"next try in {expected_wait:g}s")
    rig.now += 100.0
    rig.daemon.tick()
    rig.health = True
    assert rig.daemon.tick().startswith("supervisor restarted (5 so far)")
    rig.spawned[-1].returncode = 1
    rig.daemon.tick()
    rig.daemon.tick()
    rig.spawned[-1].returncode = 1
    assert rig.daemon.tick().endswith("next try in 1s")  # a healthy start resets the backoff


@pytest.mark.parametrize(
    ("code", "text"), [(-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"), (0, "exited 0"),
                       (3, "exited 3"), (-200, "killed by signal 200")],
)  # fmt: skip
def test_describe_exit(code, text):
    assert describe_exit(code) == text


def test_describe_exit_of_a_real_process():
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"])
    assert describe_exit(proc.wait()) == "killed by SIGKILL"


def test_training_finished_judges_the_newest_incarnation_of_the_job():
    def r(rank, state, restart=1, job="run"):
        return {"job": job, "rank": rank, "state": state, "restart": restart}

    assert training_finished([r(0, "finished"), r(1, "finished")], "run")
    assert not training_finished([r(0, "finished"), r(1, "alive")], "run")
    # the old incarnation's dead ranks do not count; the new one's do
    assert training_finished([r(0, "exited", 0), r(0, "finished"), r(1, "finished")], "run")
    assert not training_finished([r(0, "finished", 0), r(0, "alive", 1)], "run")
    assert not training_finished([r(0, "finished", job="other")], "run")
    assert not training_finished([], "run")
    assert not training_finished([{"job": "run", "state": "finished"}], "run")  # malformed


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class StuckLauncher:
    """torchrun waiting on a stand-in that cannot exit: runs until signalled."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.signals: list[str] = []

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.signals.append("SIGTERM")
        self.returncode = -15

    def kill(self) -> None:
        self.signals.append("SIGKILL")
        self.returncode = -9

    def wait(self, timeout=None) -> int | None:
        return self.returncode


@pytest.mark.parametrize(
    ("states", "stopped"), [(["finished", "finished"], True), (["finished", "alive"], False)]
)
def test_up_stops_a_launcher_that_outlives_its_finished_ranks(monkeypatch, capsys, states, stopped):
    from rankguard.cli import up

    clock = FakeTime()
    monkeypatch.setattr(up, "time", clock)
    rows = [{"job": "run", "rank": i, "restart": 0, "state": s} for i, s in enumerate(states)]
    monkeypatch.setattr(
        up, "_get", lambda url: {"ranks": rows} if url.endswith("/v1/ranks") else {}
    )
    launcher = StuckLauncher()
    if not stopped:  # a rank still training: up keeps waiting (here: until the test ends it)
        monkeypatch.setattr(clock, "sleep", lambda s: (
            setattr(clock, "now", clock.now + s),
            clock.now > 600 and setattr(launcher, "returncode", 0)))  # fmt: skip
    display = up._Display("http://sup", "http://agent", "run", None, 0.0)
    assert up._Watch(display, []).run(launcher) is stopped
    if stopped:
        assert launcher.signals == ["SIGTERM"]
        assert up.FINISHED_GRACE_SECONDS < clock.now < up.FINISHED_GRACE_SECONDS + 15
        assert "torchrun has not exited; stopping it" in capsys.readouterr().err
    else:
        assert launcher.signals == [] and clock.now > 600
