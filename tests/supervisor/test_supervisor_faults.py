"""Fault injection, end to end: real torchrun (gloo, 2 ranks), a real agent and a real
supervisor as processes. Every faulty run must finish all its steps with the parameter
digest of an uninterrupted run, and the incident must be recorded with its timings."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from harness import (
    closing_fixture,
    free_port,
    http_json,
    read_json,
    start_agent,
    start_supervisor,
    torchrun,
    wait_until,
)

pytestmark = pytest.mark.slow

STEPS = 110  # the latest fault is at step 100: room to recover and finish
# A heavier step (~75 ms here) than the tiny default (~12 ms): on a 2-core machine shared
# with the agent and the supervisor, a 12 ms step is one scheduler hiccup long, and the
# straggler window would measure the scheduler rather than the ranks.
MODEL = ["--d-model", "128", "--n-layer", "4", "--n-head", "4"]
# The straggler tests go further (~0.34 s a step). The detector counts a slowdown in steps
# (its accumulated excess adds per step), host noise comes in bursts of seconds: the longer
# the step, the fewer steps a burst spans. With ~0.2 s steps, CI's shared cores made one
# rank 1.25-1.32x slower for 5-7 s, twice in one clean run, and each was named.
STRAGGLER_MODEL = ["--d-model", "288", "--n-layer", "4", "--n-head", "4"]
BASE = ["--steps", str(STEPS), "--ckpt-every", "10", "--keep", "0", *MODEL]


class Rig:
    """An agent and a supervisor watching one node, and the trainer run under torchrun."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.agent = start_agent(tmp)
        self.supervisor = start_supervisor(tmp, [self.agent.url])

    def train(self, *args: str, max_restarts: int = 3, job: str = "job", timeout: float = 300):
        return torchrun(
            [*BASE, "--ckpt-dir", str(self.tmp / "ckpt"), "--summary", str(self.tmp / "s.json"),
             "--job", job, *args],
            cwd=self.tmp, max_restarts=max_restarts,
            env={"RANKGUARD_TELEMETRY_SOCKET": str(self.agent.socket)}, timeout=timeout,
        )  # fmt: skip

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """A query command (`rankguard health|ranks|incidents`) against this supervisor."""
        return subprocess.run(
            [sys.executable, "-m", "rankguard.cli.main", *args, "--supervisor",
             self.supervisor.url], capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def incidents(self, kind: str | None = None) -> list[dict]:
        found = http_json(self.supervisor.url + "/v1/incidents")["incidents"]
        return [i for i in found if kind is None or i["kind"] == kind]

    def ranks(self) -> list[dict]:
        return http_json(self.agent.url + "/v1/ranks")["ranks"]

    def summary(self) -> dict:
        return read_json(self.tmp / "s.json")

    def close(self) -> None:
        self.supervisor.stop()
        self.agent.stop()


rig = closing_fixture(Rig)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted reference run, supervised: it must raise no alarm at all."""
    with closing(Rig(tmp_path_factory.mktemp("clean"))) as rig:
        proc = rig.train()
        assert proc.returncode == 0, proc.stderr[-3000:]
        time.sleep(1)  # one more pass after the end
        cluster = http_json(rig.supervisor.url + "/v1/cluster")
        cli = {c: rig.cli(c, "--json") for c in ("health", "ranks", "incidents")}
        return {"summary": rig.summary(), "incidents": rig.incidents(), "cluster": cluster,
                "cli": cli}  # fmt: skip


def when_step(rig: Rig, rank: int, step: int, timeout: float = 120) -> dict:
    return wait_until(
        lambda: next((r for r in rig.ranks() if r["rank"] == rank and (r["step"] or 0) >= step
                      and r["state"] == "alive"), None),
        timeout, f"rank {rank} to reach step {step}",
    )  # fmt: skip


def in_background(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def assert_exact(rig: Rig, clean: dict) -> None:
    s = rig.summary()
    assert s["final_step"] == STEPS
    assert s["param_digest"] == clean["summary"]["param_digest"]


def test_clean_run_raises_no_hang_or_other_alarm(clean):
    """110 steps with a checkpoint every 10: no hang, no death, no numerics alarm.
    (Stragglers are judged on their own below, with a step long enough to judge.)"""
    job = clean["cluster"]["jobs"]["job"]  # the supervisor really watched it to the end
    assert (job["state"], job["max_step"]) == ("finished", STEPS), (
        clean["cluster"],
        clean["incidents"],
    )
    assert [i for i in clean["incidents"] if i["kind"] != "straggler"] == [], clean["incidents"]


def test_query_commands_on_a_healthy_run(clean):
    health, ranks, incidents = (clean["cli"][c] for c in ("health", "ranks", "incidents"))
    assert health.returncode == 0, health.stderr  # healthy
    assert json.loads(health.stdout)["jobs"]["job"]["state"] == "finished"
    assert sorted(r["rank"] for r in json.loads(ranks.stdout)["ranks"]) == [0, 1]
    assert incidents.returncode == 0 and "incidents" in json.loads(incidents.stdout)
    gone = subprocess.run([sys.executable, "-m", "rankguard.cli.main", "health", "--supervisor",
                           f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True)  # fmt: skip
    assert gone.returncode == 2 and "unreachable" in gone.stderr


def test_clean_run_raises_no_lasting_straggler(rig):
    """200 steps, about 65 s of training. On this 2-core host the ranks share their cores
    with the agent and the supervisor, and a rank is at times slowed 1.2-1.3x for a few
    seconds in ways its run-queue wait does not show (cache, the neighbour on its core):
    the detector names such a spell for as long as it lasts (twice in CI, 3 s each). What
    must hold is that no straggler lasts: every straggler incident resolved within 15 s,
    none open at the end, nothing else raised. How often the defaults name a clean run at
    all is measured over recorded runs (bench/results/straggler_replay.md)."""
    proc = torchrun(["--steps", "200", *STRAGGLER_MODEL, "--job", "long"], cwd=rig.tmp,
                    env={"RANKGUARD_TELEMETRY_SOCKET": str(rig.agent.socket)}, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    time.sleep(0.5)
    assert http_json(rig.supervisor.url + "/v1/cluster")["jobs"]["long"]["max_step"] == 200
    incidents = rig.incidents()
    shown = json.dumps(incidents, indent=1)[:4000]
    assert all(i["kind"] == "straggler" for i in incidents), shown
    assert all(i["state"] == "resolved" and i["resolved_at"] - i["detected_at"] <= 15.0
               for i in incidents), shown  # fmt: skip


def test_sigkilled_rank_detected_within_a_second_and_job_resumes_exactly(rig, clean):
    proc = rig.train("--fault", "crash:step=27:rank=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(rig, clean)
    (inc,) = rig.incidents("rank_dead")
    assert inc["rank"] == 1 and inc["time_to_detect"] < 1.0, inc
    assert inc["restarted_at"] and inc["first_step_at"] and inc["state"] == "resolved"
    assert inc["resumed_step"] == 20 and inc["lost_steps"] >= 6


def test_hung_ranks_are_found_named_and_ended(rig, clean):
    """Four hangs of rank 1 in one run, one per incarnation: frozen by SIGSTOP at step 30,
    spinning in Python at step 60, sleeping at step 90, stuck spinning in native code at
    step 100 (one run, not four: the suite's time). Each is found, named, its stacks
    captured, and ended; the job ends exact. The waiting rank 0 spins, as it looks on NCCL
    (its main thread busy, not asleep), and computes the same; a waiter blocked in the
    kernel (gloo's way) is what the other hang tests here run, and bench/hang_soak.py runs
    both ways ten times per kind."""
    in_background(lambda: os.kill(when_step(rig, 1, 30)["pid"], signal.SIGSTOP))
    proc = rig.train("--wait-mode", "spin",
                     "--fault", "spin:step=60:rank=1:restart=1",
                     "--fault", "hang:step=90:rank=1:restart=2",
                     "--fault", "native-stall:step=100:rank=1:restart=3",
                     max_restarts=4, timeout=420)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(rig, clean)
    hangs = sorted(rig.incidents("rank_hung"), key=lambda i: i["detected_at"])
    assert len(hangs) == 4, hangs
    assert hangs[0]["cause"] == "host", hangs[0]  # stopped from outside (SIGSTOP)
    for inc, step in zip(hangs, (30, 60, 90, 100), strict=True):
        assert inc["rank"] == 1 and inc["state"] == "resolved", inc
        assert step <= (inc["step_at_detect"] or 0) + 1, inc
        p99 = inc["evidence"].get("p99_step_seconds") or 0
        assert inc["time_to_detect"] <= max(10 * p99, 3.0) + 1.5, inc  # + a poll, scheduling
        stacks = json.dumps(inc["evidence"].get("stacks") or {}) + json.dumps(
            inc.get("actions", [])
        )
        assert "Thread" in stacks or "stacks" in stacks, "the culprit's stack must be captured"


# The target, named within 30 steps of a 1.2x slowdown, is measured over recorded runs in
# bench/results/straggler_replay.md; here the bound is generous (Standards: only loose
# bounds on detection times in tests), the rank named and nothing else raised are exact.
def test_straggler_named_and_nothing_else_raised(rig):
    """Rank 1 slowed 1.2x from step 60 to the end: named, and its incident stays open
    while it stays slow (to its last steps), not resolved when its ratio dips."""
    late = {}
    in_background(
        lambda: late.setdefault("at", when_step(rig, 1, 117, timeout=280) and time.time())
    )
    proc = torchrun(["--steps", "120", *STRAGGLER_MODEL, "--job", "job", "--fault",
                     "slow:step=60:rank=1:factor=1.2"], cwd=rig.tmp,
                    env={"RANKGUARD_TELEMETRY_SOCKET": str(rig.agent.socket)}, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (inc,) = rig.incidents("straggler")
    shown = json.dumps(inc, indent=1)[:4000]
    assert inc["rank"] == 1, inc
    assert inc["step_at_detect"] - 60 <= 45, shown
    assert "at" in late and (inc["resolved_at"] or time.time()) >= late["at"], shown
    assert rig.incidents("rank_hung") == [] and rig.incidents("rank_dead") == []


def test_nan_loss_resumes_from_a_checkpoint_before_it(rig, clean):
    proc = rig.train("--fault", "nan:step=75:rank=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(rig, clean)
    (inc,) = rig.incidents("bad_numerics")
    assert inc["resumed_step"] is not None and inc["resumed_step"] < 75, inc
    assert inc["cause"] == "data", inc


def test_corrupt_newest_checkpoint_at_restart_falls_back(rig, clean):
    def corrupt_then_wait():
        when_step(rig, 0, 73)
        shard = rig.tmp / "ckpt" / "step-00000070" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    in_background(corrupt_then_wait)
    proc = rig.train("--fault", "crash:step=78:rank=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(rig, clean)
    (inc,) = rig.incidents("rank_dead")
    assert inc["resumed_step"] == 60, inc
    assert any(
        p.name.startswith("step-00000070") for p in (rig.tmp / "ckpt" / "quarantine").iterdir()
    )


@pytest.mark.parametrize("wait_mode", ["block", "spin"])
def test_a_collective_timeout_names_the_rank_waited_for_not_the_first_to_die(tmp_path, wait_mode):
    """The watchdog decides here: the hang detector is off and the process groups time out
    after 4 s (NCCL's watchdog aborts; gloo raises). Rank 0 dies first, of the timeout;
    the incident names rank 1, which never enqueued the collective rank 0 waited in, from
    the wavefronts the ranks sent while the job was stalled."""
    config = tmp_path / "supervisor.toml"
    config.write_text("[detectors.hang]\nenabled = false\n")
    agent = start_agent(tmp_path)
    sup = start_supervisor(tmp_path, [agent.url], extra=["--config", str(config)])
    try:
        proc = torchrun(
            ["--steps", "60", *MODEL, "--job", "job", "--pg-timeout", "4", "--wait-mode",
             wait_mode, "--fault", "hang:step=20:rank=1"], cwd=tmp_path,
            env={"RANKGUARD_TELEMETRY_SOCKET": str(agent.socket)}, timeout=120,
        )  # fmt: skip
        assert proc.returncode != 0, proc.stderr[-3000:]
        # warned at start: a 4 s timeout leaves rankguard no time to decide first
        assert "times out after 4s, sooner than rankguard can name" in proc.stderr

        def found():
            incs = http_json(sup.url + "/v1/incidents")["incidents"]
            return next((i for i in incs if i["kind"] == "rank_dead"), None)

        inc = wait_until(found, 10, "the death's incident")
        ev = inc["evidence"]
        assert inc["rank"] == 1 and ev.get("cause") == "nccl_timeout", inc
        assert (inc["cause"], inc["cause_confidence"]) == ("collective", "high"), inc
        assert ev["first_to_die"]["rank"] == 0, inc
        assert ev["wavefront"]["reached"]["1"] < ev["wavefront"]["reached"]["0"], inc
    finally:
        sup.stop()
        agent.stop()


def test_a_desync_stops_the_job_with_a_verdict_and_no_restart(rig):
    """Rank 1 broadcasts where rank 0 all-reduces, at the same collective sequence id:
    both wait for good. The flight recorders show the mismatch; the job is stopped with a
    verdict naming both operations, never restarted (a restart would repeat the bug)."""
    proc = rig.train("--fault", "desync:step=40:rank=1", max_restarts=3, timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "sooner than rankguard can name" not in proc.stderr  # torch's 30 min timeout
    (inc,) = rig.incidents("rank_hung")
    ev = inc["evidence"]
    assert ev.get("desync") is True and ev["wavefront"]["verdict"] == "desync", inc
    assert inc["cause"] == "user_code", inc  # ranks that call different collectives
    assert "gloo:broadcast" in inc["summary"] and "gloo:all_reduce" in inc["summary"], inc
    (act,) = inc["actions"]
    assert act["kind"] == "stop_job" and "desync" in (inc["verdict"] or act["reason"]), inc
    assert {r["restart"] for r in rig.ranks()} == {0}, rig.ranks()  # never restarted
    cluster = http_json(rig.supervisor.url + "/v1/cluster")
    assert cluster["jobs"]["job"]["state"] == "stopped", cluster
    timeline = rig.cli("incidents").stdout  # the wavefront, for an operator
    assert "flight recorder: desync in group 0, collective" in timeline, timeline


def test_crash_loop_is_stopped_with_a_verdict(rig):
    proc = rig.train("--fault", "crash:step=25:rank=1:restart=any", max_restarts=10)
    assert proc.returncode != 0
    (loop,) = rig.incidents("crash_loop")
    assert "crash loop" in (loop["verdict"] or loop["summary"]).lower(), loop
    # the death that tips the loop is recorded as well when an agent announces it
    # (/v1/rank-events) before torchrun's next restart; the stop ends it with the job
    deaths = rig.incidents("rank_dead")
    assert len(deaths) in (3, 4), deaths
    assert all(d["state"] in ("resolved", "stopped") for d in deaths), deaths
    cluster = http_json(rig.supervisor.url + "/v1/cluster")
    assert cluster["status"] == "unhealthy" and cluster["jobs"]["job"]["state"] == "stopped"
    health = rig.cli("health")
    assert health.returncode == 2 and "stopped" in health.stdout, health.stdout
    timeline = rig.cli("incidents").stdout
    assert "crash_loop" in timeline and "verdict:" in timeline and "rank_dead" in timeline


def test_supervisor_restart_mid_run_never_acts_twice(rig, clean):
    def kill_supervisor_after_it_acts():
        wait_until(lambda: any(i["state"] in ("recovering", "resolved") for i in rig.incidents("rank_hung")),
                   120, "the hang to be acted on")  # fmt: skip
        rig.supervisor.kill()
        rig.supervisor = start_supervisor(rig.tmp, [rig.agent.url], db=rig.tmp / "rankguard.db")

    in_background(kill_supervisor_after_it_acts)
    proc = rig.train("--fault", "spin:step=60:rank=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(rig, clean)
    wait_until(
        lambda: rig.incidents("rank_hung")[0]["state"] == "resolved", 30, "recovery recorded"
    )
    (inc,) = rig.incidents("rank_hung")
    with sqlite3.connect(rig.tmp / "rankguard.db") as db:
        kills = db.execute("SELECT COUNT(*) FROM actions WHERE incident_id = ? AND kind = 'kill_rank'",
                           (inc["id"],)).fetchone()[0]  # fmt: skip
    assert kills == 1
