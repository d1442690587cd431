"""A supervisor killed at any step of a recovery and restarted goes on as if nothing
happened: real torchrun (gloo, 2 ranks), a real agent, the supervisor as a process that a
fault point (RANKGUARD_SUPERVISOR_FAULT) SIGKILLs mid-recovery. The restarted supervisor
must finish the recovery exactly once (one kill, one group restart), keep one incident with
its timeline, and go on with the job's state and goodput where the dead one left them."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import http_json, start_agent, start_supervisor, trainer_command, wait_until

pytestmark = pytest.mark.slow

STEPS = 100
HANG_AT = 50  # rank 1 spins at step 50 of the first incarnation; the supervisor kills it
TRAIN = ["--steps", str(STEPS), "--ckpt-every", "10", "--keep", "0", "--job", "job",
         "--fault", f"spin:step={HANG_AT}:rank=1"]  # fmt: skip


def db_rows(db: Path, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        c.row_factory = sqlite3.Row
        return c.execute(sql, args).fetchall()


@pytest.mark.parametrize("point", ["mid_pass", "before_action", "after_action", "during_restart"])
def test_supervisor_killed_mid_recovery_finishes_it_once(tmp_path, point):
    agent = start_agent(tmp_path)
    db = tmp_path / "rankguard.db"
    sup = start_supervisor(tmp_path, [agent.url], db=db, env={"RANKGUARD_SUPERVISOR_FAULT": point})
    cmd, env = trainer_command(
        [*TRAIN, "--ckpt-dir", str(tmp_path / "ckpt"), "--summary", str(tmp_path / "s.json")],
        max_restarts=3, env={"RANKGUARD_TELEMETRY_SOCKET": str(agent.socket)},
    )  # fmt: skip
    with open(tmp_path / "torchrun.log", "w") as log:  # the child keeps its own copy
        train = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_until(lambda: sup.proc.poll() is not None, 120, f"the supervisor to die at {point}")
        assert sup.proc.returncode == -signal.SIGKILL, sup.log.read_text()[-2000:]
        # what the dead supervisor left behind
        (hang,) = db_rows(db, "SELECT * FROM incidents WHERE kind = 'rank_hung'")
        kills = db_rows(db, "SELECT * FROM actions WHERE incident_id = ?", (hang["id"],))
        (job_before,) = db_rows(db, "SELECT * FROM jobs WHERE job = 'job'")
        if point == "mid_pass":  # recorded, nothing decided yet
            assert kills == [] and hang["state"] == "open", dict(hang)
        elif point == "during_restart":
            (kill,) = kills
            assert kill["ok"] == 1 and hang["state"] == "recovering", dict(hang)
        else:  # the intent is there, its outcome is not
            (kill,) = kills
            assert kill["completed_at"] is None and hang["state"] == "acting", dict(hang)

        sup = start_supervisor(tmp_path, [agent.url], db=db)  # no fault point this time
        first = wait_until(lambda: http_json(sup.url + "/v1/cluster")["jobs"], 30, "a first pass")
        assert first["job"]["first_seen"] == job_before["first_seen"], (first, dict(job_before))
        assert first["job"]["useful_seconds"] >= job_before["useful_seconds"]
        assert first["job"]["state"] in ("recovering", "running"), first

        assert train.wait(timeout=180) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
        wait_until(
            lambda: http_json(sup.url + "/v1/cluster")["jobs"]["job"]["state"] == "finished",
            20, "the job seen finished",
        )  # fmt: skip
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
        sup.stop()
        agent.stop()

    s = json.loads((tmp_path / "s.json").read_text())
    assert s["final_step"] == STEPS and s["restart_count"] == 1, s  # one group restart
    incidents = {r["kind"]: r for r in db_rows(db, "SELECT * FROM incidents")}
    assert sorted(k for k in incidents if k != "straggler") == ["rank_hung"], incidents.keys()
    hang = incidents["rank_hung"]
    assert hang["state"] == "resolved" and hang["restarted_at"] and hang["first_step_at"]
    (kill,) = db_rows(db, "SELECT * FROM actions WHERE incident_id = ?", (hang["id"],))
    assert kill["kind"] == "kill_rank" and kill["ok"] == 1, dict(kill)
    replayed = "replayed" in (kill["result"] or "")
    assert replayed == (point == "after_action"), dict(kill)  # carried out once, by one of them
    what = [r["what"] for r in db_rows(db, "SELECT what FROM events WHERE incident_id = ? "
                                           "ORDER BY at, id", (hang["id"],))]  # fmt: skip
    for step in ("detected", "kill_rank requested", "kill_rank done", "group restarted",
                 "first new step", "resolved"):  # fmt: skip
        assert what.count(step) == 1, (step, what)
    (job_after,) = db_rows(db, "SELECT * FROM jobs WHERE job = 'job'")
    assert job_after["first_seen"] == job_before["first_seen"]
    assert job_after["max_step"] == STEPS and job_after["state"] == "finished"
    assert job_after["useful_seconds"] > job_before["useful_seconds"]


def test_a_second_supervisor_on_one_database_refuses_to_start(tmp_path):
    agent = start_agent(tmp_path)
    first = start_supervisor(tmp_path, [agent.url])
    try:
        second = subprocess.run(
            [sys.executable, "-m", "rankguard.cli.main", "supervisor", "--bind", "127.0.0.1:0",
             "--db", str(tmp_path / "rankguard.db"), "--agents", agent.url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "another supervisor" in lines[0], second.stderr
        assert f"pid {first.proc.pid}" in lines[0], lines
        assert http_json(first.url + "/healthz")["ok"]  # the first goes on
        first.kill()  # a crash: the kernel drops the lock with the process
        time.sleep(0.2)
        again = start_supervisor(tmp_path, [agent.url])
        again.stop()
    finally:
        first.stop()
        agent.stop()
