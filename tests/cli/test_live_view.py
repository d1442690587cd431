"""`rankguard up`'s view (cli/live_view.py): literal answers in, words and numbers out."""

from __future__ import annotations

import io

from rich.console import Console

from rankguard.cli import live_view as lv


def rank(r, state="alive", step=120, phase="train", restart=0, **kw):
    return {"job": "run", "rank": r, "state": state, "step": step, "phase": phase,
            "restart": restart, "tokens_per_second": 1000.0, "mfu": 0.25, "loss": 3.5,
            "checkpoint_step": 100, **kw}  # fmt: skip


CLUSTER = {"status": "healthy", "jobs": {"run": {"state": "running", "max_step": 120,
           "newest_checkpoint_step": 100, "useful_seconds": 30.0}}}  # fmt: skip
INCIDENT = {"id": 1, "job": "run", "kind": "rank_dead", "rank": 1, "state": "recovering",
            "summary": "rank 1 exited", "action": "restart_job", "occurred_at": 100.0,
            "detected_at": 100.4, "acted_at": None, "restarted_at": 102.0,
            "first_step_at": None, "resolved_at": None, "lost_steps": None}  # fmt: skip


def snap(**kw):
    base = dict(job="run", elapsed=65.0, total_steps=300, cluster=CLUSTER,
                ranks=[rank(0), rank(1, step=119)], incidents=[])  # fmt: skip
    return lv.Snapshot(**{**base, **kw})


def test_a_restarted_rank_without_a_known_resume_reads_restarted():
    """A zero-code script's rank is only a process (no phase, no step): after a restart it
    is "restarted", never "resuming" from a checkpoint nobody saw; a trainer rank that
    restarts before any checkpoint starts over, and says so too."""
    plain = [rank(r, step=None, phase=None, restart=1, checkpoint_step=None) for r in (0, 1)]
    v = lv.view(snap(ranks=plain, cluster={"status": "healthy", "jobs": {}}, total_steps=None))
    assert [(r.state, r.detail) for r in v.ranks] == [("restarted", "restart 1")] * 2
    assert "resuming" not in lv.plain_line(v) and v.step is None
    early = [rank(0, step=0, phase="init", restart=1, checkpoint_step=None)]
    cluster = {"status": "healthy", "jobs": {"run": {"newest_checkpoint_step": None}}}
    assert lv.view(snap(ranks=early, cluster=cluster)).ranks[0].state == "restarted"
    loading = [rank(0, step=0, phase="checkpoint_load", restart=1, checkpoint_step=None)]
    assert lv.view(snap(ranks=loading, cluster=cluster)).ranks[0].state == "resuming"


def test_goodput_of_a_job_without_steps_is_unknown_not_zero():
    out = lv.Outcome("completed", 20.0, None, None, None, [])
    assert "goodput unknown" in lv.summary_lines(out)[0]
    assert "0.0%" not in lv.summary_lines(out)[0]


def test_training_shows_progress_eta_throughput_and_loss():
    v = lv.view(snap(), speed=2.0)
    assert (v.step, v.total_steps, v.eta_seconds) == (120, 300, 90.0)
    assert v.tokens_per_second == 2000.0 and v.mfu == 0.25 and v.loss == 3.5
    line = lv.plain_line(v)
    for part in ("[healthy] job running", "step 120/300 (40%)", "eta 1:30", "tokens/s 2,000",
                 "mfu 25.0%", "loss 3.5000", "r0 training@120", "r1 training@119"):  # fmt: skip
        assert part in line, line
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(lv.panel(v))
    text = out.getvalue()
    for part in ("step 120/300", "tokens/s 2,000", "MFU 25.0%", "loss 3.5000", "training"):
        assert part in text, text


def test_a_restarting_rank_reads_as_resuming_from_its_checkpoint_not_step_0():
    ranks = [rank(0, step=0, phase="checkpoint_load", restart=1, checkpoint_step=None),
             rank(1, step=0, phase="init", restart=1, checkpoint_step=None)]  # fmt: skip
    cluster = {"status": "degraded", "jobs": {"run": {"state": "recovering",
               "newest_checkpoint_step": 0}}}  # fmt: skip
    # the ranks and the supervisor know no checkpoint yet; up remembered step 100
    v = lv.view(snap(ranks=ranks, cluster=cluster, checkpoint_step=100, incidents=[INCIDENT]))
    assert [r.state for r in v.ranks] == ["resuming", "resuming"]
    assert all(r.step is None and r.detail == "restart 1, from checkpoint 100" for r in v.ranks)
    assert v.step == 100 and v.eta_seconds is None
    line = lv.plain_line(v)
    assert "@0" not in line and "r1 resuming (restart 1, from checkpoint 100)" in line
    assert v.open_incidents == ("#1 rank_dead rank 1 [recovering]",)
    assert v.timeline == ("+  0.0s fault", "+  0.4s detected", "+  2.0s restarted")


def test_states_are_full_words_and_the_newest_incarnation_wins():
    ranks = [rank(0, state="exited", step=57), rank(0, state="finished", step=300, restart=1),
             rank(1, state="stopped"), rank(2, phase="checkpoint_save"), rank(3, state="zombie"),
             {**rank(4), "job": "other"}]  # fmt: skip
    v = lv.view(snap(ranks=ranks))
    assert [(r.rank, r.state) for r in v.ranks] == [
        (0, "finished"), (1, "stopped"), (2, "saving"), (3, "zombie")]  # fmt: skip


def test_figures_stand_while_no_rank_trains_and_without_a_supervisor():
    before = lv.view(snap())
    done = [rank(0, state="finished", step=300, phase="done"), rank(1, state="finished", step=300)]
    v = lv.view(snap(ranks=done, cluster=None), previous=before)
    assert v.status == "no supervisor" and v.step == 300
    assert (v.tokens_per_second, v.loss) == (2000.0, 3.5)
    assert "waiting for ranks" in lv.plain_line(lv.view(snap(ranks=[])))


def test_speed_from_observations_starts_again_after_a_restart():
    assert lv.steps_per_second([]) is None
    assert lv.steps_per_second([(0.0, 10)]) is None
    assert lv.steps_per_second([(0.0, 10), (5.0, 20), (10.0, 30)]) == 2.0
    # the step went back (a restart resumed from a checkpoint): only what follows counts
    assert lv.steps_per_second([(0.0, 10), (5.0, 60), (10.0, 40), (14.0, 48)]) == 2.0
    assert lv.eta(120, 300, None) is None and lv.eta(300, 300, 1.0) == 0.0


def test_summary_counts_goodput_and_incidents():
    resolved = {**INCIDENT, "state": "resolved", "time_to_recover": 4.25}
    o = lv.Outcome(how="completed", wall_seconds=120.0, step=300, total_steps=300,
                   useful_seconds=90.0, incidents=[resolved], final_loss=2.5)  # fmt: skip
    lines = lv.summary_lines(o)
    assert lines[0] == ("rankguard up: summary: completed; steps 300/300 in 2:00 (120.0s); "
                        "goodput 75.0% (useful step time 90.0s); final loss 2.5000")  # fmt: skip
    assert lines[1] == "rankguard up: summary: incidents 1 (1 rank_dead)"
    assert "recovered in 4.2s" in lines[2]
    quiet = lv.Outcome("interrupted (Ctrl-C)", 10.0, None, None, None, [])
    assert lv.summary_lines(quiet) == [
        "rankguard up: summary: interrupted (Ctrl-C); steps - in 0:10 (10.0s); goodput unknown",
        "rankguard up: summary: incidents 0",
    ]
    assert lv.goodput(200.0, 100.0) == 1.0
