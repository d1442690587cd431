"""`rankguard up`: the main job on one machine, with a fault injected on schedule."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys

import pytest

from rankguard.contract import exit_codes

pytestmark = pytest.mark.slow


def test_up_trains_through_an_injected_kill(tmp_path):
    """Warm workers by default; the restart's phases, measured by the workers themselves,
    are in the incident's timeline and `rankguard incidents` shows them."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--steps", "200", "--ckpt-every", "20",
         "--run-dir", str(run), "--inject", "kill:rank=1:at=8s",
         "--trainer-arg=--d-model=128", "--trainer-arg=--n-layer=4", "--trainer-arg=--n-head=4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "training completed: step 200" in proc.stdout
    assert "injected kill: SIGKILL to rank 1" in proc.stdout
    # not a terminal: plain lines, no escape codes, and the closing summary
    assert "\x1b[" not in proc.stdout
    plain = re.findall(r"^ +[0-9]+:[0-9]{2} \[\w+\] job \S+ \| step \S+ .*\| tokens/s \S+ \| "
                       r"mfu \S+ \| loss \S+ \| .* \| incidents \d+ open \d+", proc.stdout, re.M)  # fmt: skip
    assert len(plain) >= 2, proc.stdout
    assert re.search(r"step [0-9]+/200 \([0-9]+%\)", proc.stdout)
    assert re.search(r"summary: completed; steps 200/200 in [0-9:]+ \([0-9.]+s\); goodput "
                     r"[0-9.]+%", proc.stdout), proc.stdout[-2000:]  # fmt: skip
    assert re.search(r"summary: incidents [1-9][0-9]* \(.*rank_dead", proc.stdout)
    assert (run / "warm.log").is_file()  # the warm server ran
    assert "starting cold" not in (run / "trainer.log").read_text()
    with sqlite3.connect(run / "rankguard.db") as db:
        kinds = [k for (k,) in db.execute("SELECT kind FROM incidents")]
        (inc,) = db.execute(
            "SELECT id, occurred_at, first_step_at FROM incidents WHERE kind = 'rank_dead'"
        ).fetchall()
        events = db.execute(
            "SELECT detail FROM events WHERE incident_id = ? AND what = 'restart phases'", (inc[0],)
        ).fetchall()
    assert "rank_dead" in kinds
    assert len(events) == 1, events
    phases = json.loads(events[0][0])
    names = ("respawn", "imports", "rendezvous", "build", "state_load", "first_step")
    assert all(isinstance(phases[k], float) and phases[k] >= 0 for k in names), json.dumps(phases)
    # teardown is split off only when the supervisor saw every old rank's exit before the
    # new ranks appeared; a restart faster than the agent's 0.5 s interval (since session
    # 13's rendezvous without torch's random wait) often is not, and respawn spans both
    teardown = phases["teardown"]
    assert teardown is None or (isinstance(teardown, float) and teardown >= 0), phases
    names += ("teardown",) if teardown is not None else ()
    # the phases run from the fault to the first new step; the supervisor sees that step
    # at its next pass, so its own fault -> first step is the longer, by at most a few passes
    total = sum(phases[k] for k in names)
    assert 0 < total <= inc[2] - inc[1] + 0.05, (phases, inc)
    assert phases["imports"] < 0.5, phases  # warm: forked, torch already imported
    listed = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "incidents", "--db", str(run / "rankguard.db")],
        capture_output=True, text=True,
    )  # fmt: skip
    first = "restart: teardown" if teardown is not None else "restart: respawn"
    assert first in listed.stdout and "state load" in listed.stdout, listed.stdout
    # one machine: its supervisor never drains this node in a scheduler
    assert "drain = false" in (run / "supervisor.toml").read_text()


def test_up_warm_start_crash_loop_is_stopped_through_the_launcher(tmp_path):
    """Warm-started workers (the default) are forked by the warm server, not by torchrun; the agent
    still finds their torchrun launcher (through the shim), so the crash-loop guard stops
    the job (exit 3) rather than SIGTERMing ranks that torchrun would restart."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--steps", "60",
         "--ckpt-every", "20", "--run-dir", str(run),
         "--trainer-arg=--fault=crash:step=25:rank=1:restart=any"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # a crash loop of self-inflicted SIGKILLs: the loop outweighs "maybe the OOM killer"
    assert proc.returncode == exit_codes.USER_ERROR.code, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped the job" in proc.stderr
    # the verdict names the checkpoint every restart resumed from, not "no checkpoint"
    assert "without checkpoint progress past step 20" in proc.stderr, proc.stderr[-2000:]
    with sqlite3.connect(run / "rankguard.db") as db:
        rows = db.execute("SELECT kind, key, evidence FROM incidents ORDER BY id").fetchall()
    kinds = [k for k, _, _ in rows]
    assert "crash_loop" in kinds, kinds
    stop = kinds.index("crash_loop")
    before = kinds[:stop]
    # stopped after three restarts without progress, each one a recorded death
    stuck = json.loads(rows[stop][2])["restarts"]
    assert len(stuck) == 3 and set(stuck) <= {key for _, key, _ in rows[:stop]}, rows
    # every death before the stop is a rank_dead: three (each restart from step 20 counts),
    # or four when the first incarnation died before its report of step 20 reached the
    # agent, so its restart counts as progress. A later incarnation's death carries the
    # checkpoint it reported on /v1/rank-events (agent/ranks.py): warm incarnations die
    # 0.4 s apart, within one 0.5 s poll, and were recorded with none (a fifth death,
    # seen in CI before). An incarnation torchrun had started just before the stop landed
    # dies of the stop itself and may be recorded after it. Five, when a loaded machine
    # delivered checkpoint 20's report only after the second death (warm deaths come 0.7 s
    # apart): the first restarts then count as progress (seen in CI).
    assert before == ["rank_dead"] * len(before) and len(before) in (3, 4, 5), rows
    log = (run / "trainer.log").read_text()
    resumed = re.findall(r"resumed from step (\d+)", log)
    assert len(resumed) >= 2 and set(resumed) == {"20"}, resumed  # the loop: no progress
    assert "starting cold" not in log  # really warm
