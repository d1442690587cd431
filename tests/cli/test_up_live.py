"""`rankguard up` on a terminal, as an operator runs it: the live panel (progress, tokens/s,
loss, ranks, incidents), every kind of `rankguard inject` from a second shell against it,
each observed (issue 20), and Ctrl-C ending it with a summary (issue 17).

One up run for the whole module (the tests run in file order, each on the state the
previous one left): the faults are injected one after another, each once the job has
recovered from the last and written a newer checkpoint (so the crash-loop guard, which
stops restarts without checkpoint progress, stays out of it)."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time

import pytest
from harness import RANKGUARD, http_json, wait_until
from up_run import UpPty, left_running

pytestmark = pytest.mark.slow


class Run:
    def __init__(self, up: UpPty):
        self.up = up
        first = up.wait_for(r"\| agent (http://\S+) \| supervisor (http://\S+) \|", 120)
        self.agent, self.supervisor = first.group(1), first.group(2)
        exports = up.wait_for(r"export (RANKGUARD_SUPERVISOR=.*)", 10).group(1)
        self.env = {**os.environ, **dict(kv.split("=", 1) for kv in exports.split())}
        self.job = up.run.name
        self.seen_incidents = 0
        self.checkpoint = 0

    def ranks(self) -> list[dict]:
        rows = http_json(self.agent + "/v1/ranks")["ranks"]
        newest = max((r["restart"] for r in rows), default=0)
        return [r for r in rows if r["restart"] == newest]

    def incidents(self) -> list[dict]:
        return http_json(self.supervisor + "/v1/incidents")["incidents"]

    def inject(self, *args: str) -> str:
        """`rankguard inject` from a second shell: only the variables up printed."""
        proc = subprocess.run([*RANKGUARD, "inject", *args], env=self.env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def training(self, timeout: float = 90) -> list[dict]:
        """Both ranks training past a checkpoint newer than any before the last fault."""

        def ready():
            rows = self.ranks()
            ok = len(rows) == 2 and all(
                r["state"] == "alive" and r["phase"] == "train"
                and (r["checkpoint_step"] or 0) > self.checkpoint for r in rows
            )  # fmt: skip
            return rows if ok else None

        rows = wait_until(ready, timeout, f"both ranks training past checkpoint {self.checkpoint}")
        self.checkpoint = min(r["checkpoint_step"] for r in rows)
        return rows

    def recovered(self, kind: str, rank: int, timeout: float = 90) -> dict:
        """The next incident: of this kind and rank, resolved (the job trains again)."""

        def resolved():
            new = [i for i in self.incidents() if i["id"] > self.seen_incidents]
            return next((i for i in new if (i["kind"], i["rank"], i["state"])
                         == (kind, rank, "resolved")), None)  # fmt: skip

        inc = wait_until(resolved, timeout, f"a resolved {kind} incident of rank {rank}")
        self.seen_incidents = max(i["id"] for i in self.incidents())
        return inc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # warm start (the default): a SIGKILLed rank is named as itself since the agent kills
    # a warm rank before its stand-in (docs/architecture.md)
    up = UpPty(tmp_path_factory.mktemp("live"), "--steps", "100000", "--ckpt-every", "20")
    try:
        yield Run(up)
    finally:
        up.close()
        print(up.text()[-3000:])


def test_the_live_panel_shows_progress_throughput_and_loss(run):
    run.training()
    run.up.wait_for(r"tokens/s [0-9][0-9,]*\s+MFU [0-9.]+%\s+loss [0-9]+\.[0-9]{4}", 60)
    assert re.search(r"step [0-9]+/100000 .*[0-9]+%", run.up.text())
    assert re.search(r"\b0\s+training\s+[0-9]+", run.up.text())  # the rank table, full words
    assert "rankguard up: run " in run.up.text() and "export RANKGUARD_SUPERVISOR=" in run.up.text()


def test_inject_kill(run):
    out = run.inject("kill", "--rank", "1")
    assert re.match(r"injected kill: SIGKILL to rank 1 of job \S+ \(pid \d+\)", out), out
    inc = run.recovered("rank_dead", 1)
    assert inc["action"] and inc["first_step_at"]
    # the panel names the incident and its timeline
    run.up.wait_for(r"last: #\d+ rank_dead rank 1 \[(recovering|resolved)\]", 30)
    run.up.wait_for(r"\+\s*[0-9.]+s detected", 10)


def test_inject_hang_and_corrupt_checkpoint_the_resume_refuses(run):
    """A hang freezes the job; the newest checkpoint is corrupted while it is frozen, so
    the restart after the hang must refuse it and resume from an older one."""
    run.training()
    out = run.inject("hang:rank=1")
    step = int(re.search(r"at step (\d+)", out).group(1))
    # frozen: both ranks reached the step rank 1 hangs at, and report nothing newer
    wait_until(lambda: all((r["step"] or 0) >= step - 1 for r in run.ranks()), 60, "the hang")
    assert all(r["step"] == step - 1 for r in run.ranks()), run.ranks()
    out = run.inject("corrupt-checkpoint")
    corrupted = int(re.search(r"in step (\d+)", out).group(1))
    inc = run.recovered("rank_hung", 1)
    assert inc["action"] == "kill_rank"
    log = (run.up.run / "trainer.log").read_text(errors="replace")
    assert re.search(rf"quarantined checkpoint \S*step-0*{corrupted}\b", log), log[-3000:]
    assert inc["resumed_step"] is None or inc["resumed_step"] < corrupted
    run.checkpoint = 0  # the resume went back past the corrupted one


def test_inject_nan(run):
    run.training()
    out = run.inject("nan", "--rank", "0")
    assert out.startswith("injected nan: rank 0 of job"), out
    inc = run.recovered("bad_numerics", 0)
    assert inc["action"]


def test_inject_exception(run):
    run.training()
    result = json.loads(run.inject("exception:rank=1", "--json"))
    assert (result["kind"], result["rank"]) == ("exception", 1)
    run.recovered("rank_dead", 1)  # the rank exited with the exception; the group restarted


def test_inject_slow(run):
    """A slowed rank: its compute time grows by the factor (against its own before: its
    peer may wait for it inside backward, where the wait counts as compute)."""
    run.training()
    samples = []  # the median of a few reads: one step's compute time is noisy under load
    for _ in range(5):
        samples.append({r["rank"]: r["compute_seconds"] for r in run.ranks()}[1])
        time.sleep(0.3)
    before = statistics.median(s for s in samples if s)
    result = json.loads(run.inject("slow", "--rank", "1", "--factor", "4", "--json"))
    assert result["spec"].startswith("slow:rank=1:step=")

    def slowed():
        rows = {r["rank"]: r for r in run.ranks()}
        if (rows[1]["step"] or 0) < result["step"] + 5:
            return None
        c1 = rows[1]["compute_seconds"]
        return c1 if before and c1 and c1 > 2 * before else None

    wait_until(slowed, 90, "rank 1's compute time at least twice its own before the fault")


def test_ctrl_c_stops_training_and_prints_the_summary(run):
    started = time.monotonic()
    os.kill(run.up.proc.pid, signal.SIGINT)  # up alone, as a shell's Ctrl-C reaches it first
    code = run.up.wait(timeout=120)
    text = run.up.text()
    assert code == 130, text[-3000:]
    assert "interrupted (Ctrl-C): stopping training" in text
    m = re.search(r"summary: interrupted \(Ctrl-C\); steps (\d+)/100000 in [0-9:]+ "
                  r"\([0-9.]+s\); goodput ([0-9.]+)%", text)  # fmt: skip
    assert m and int(m.group(1)) > 0 and 0 < float(m.group(2)) <= 100, text[-3000:]
    incidents = re.search(r"summary: incidents (\d+) \((.*)\)", text)
    assert incidents and int(incidents.group(1)) >= 4, text[-3000:]
    for kind in ("rank_dead", "rank_hung", "bad_numerics"):
        assert kind in incidents.group(2)
    assert "rankguard incidents --db" in text and "Traceback" not in text
    assert time.monotonic() - started < 60
    assert left_running(run.up.run) == []
