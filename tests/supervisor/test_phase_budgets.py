"""Per-phase hang budgets learned from the job's history, and the evidence that needs no
budget (supervisor/phase_budgets.py, detectors/hang.py): literal observations only."""

from __future__ import annotations

import dataclasses

import pytest
from builders import CFG, T0, cluster, rank, samples

from rankguard.service.settings import SettingsError
from rankguard.supervisor import config as sup_config
from rankguard.supervisor.detectors import hang
from rankguard.supervisor.history import History, advance
from rankguard.supervisor.phase_budgets import PhaseBudgetConfig, PhaseTrace, budget

P = CFG.hang.phases


def at(t, *ranks):
    return cluster(*ranks, time=T0 + t)


def step_through(obs_list, history=None):
    history = history or History()
    for obs in obs_list:
        history = advance(history, obs, CFG)
    return history


def test_budget_is_the_default_until_learned_then_a_quantile_with_a_floor():
    empty = PhaseTrace()
    b = budget(empty, "j", "checkpoint_load", P)
    assert (b.seconds, b.source) == (120.0, "default") and "default" in b.describe(P)
    slow = PhaseTrace(durations={"j": {"checkpoint_load": (4.0, 5.0, 6.0)}})
    b = budget(slow, "j", "checkpoint_load", P)
    assert b.source == "learned" and b.seconds == pytest.approx(3.0 * 5.9)
    assert "learned" in b.describe(P) and "3 past checkpoint_load" in b.describe(P)
    fast = PhaseTrace(durations={"j": {"init": (0.2,)}})
    assert budget(fast, "j", "init", P).seconds == 5.0  # the floor
    assert budget(fast, "other", "init", P).source == "default"  # per job


def test_advance_learns_phase_durations_from_what_ranks_report():
    # a restarted incarnation (restart 1): init (announced at process start), a 4 s
    # checkpoint load, the first step, then training
    def r(n, phase, age, recent=()):
        return rank(n, restart=1, phase=phase, age=age, step=20, recent=recent)

    passes = [
        at(0.0, r(0, "init", 0.5), r(1, "init", 0.5)),  # entered at 0.5 s before
        at(3.0, r(0, "checkpoint_load", 0.0), r(1, "checkpoint_load", 0.0)),
        at(7.0, r(0, "train", 0.0), r(1, "train", 0.0)),  # first step begins
        at(8.0, *[r(n, "train", 0.0, samples(21, 22, restart=1)) for n in (0, 1)]),
    ]
    d = step_through(passes).phases.durations["j"]
    assert d["init"] == (3.5, 3.5)
    assert d["checkpoint_load"] == (4.0, 4.0)
    assert d["first_step"] == (1.0, 1.0)


def test_a_death_or_a_suspend_is_not_a_phase_duration():
    dead = [
        at(0.0, rank(0, phase="checkpoint_load", age=0), rank(1, phase="checkpoint_load", age=0)),
        at(5.0, rank(0, phase="checkpoint_load", age=5), rank(1, state="exited", phase="init")),
    ]
    assert "checkpoint_load" not in step_through(dead).phases.durations.get("j", {})
    suspend = [
        at(0.0, *[rank(n, phase="checkpoint_save", age=0) for n in (0, 1)]),
        at(1.0, *[rank(n, phase="checkpoint_save", age=1, state="stopped") for n in (0, 1)]),
        at(9.0, *[rank(n, phase="train", age=0, recent=samples(1, 10)) for n in (0, 1)]),
    ]
    h = step_through(suspend)
    assert h.phases.suspended_at["j"] == T0 + 1.0
    assert "checkpoint_save" not in h.phases.durations.get("j", {})


def test_a_slow_save_is_within_its_budget_and_a_stuck_one_is_caught():
    learned = History(phases=PhaseTrace(durations={"j": {"checkpoint_save": (2.0, 2.5, 2.0)}}))
    trainee = samples(1, 30)

    def saving(age):
        return at(0, *[rank(n, phase="checkpoint_save", step=30, age=age, recent=trainee)
                       for n in (0, 1)])  # fmt: skip

    # learned: max(5, 3 x p95 2.45 s) = 7.35 s
    assert hang.detect(saving(6.0), learned, CFG) == []
    [f] = hang.detect(saving(8.0), learned, CFG)
    assert f.evidence["hung_phase"] == "checkpoint_save" and f.evidence["decided_by"] == "budget"
    assert f.evidence["budget"]["source"] == "learned"
    assert f.evidence["budget"]["seconds"] == pytest.approx(7.35)
    assert "checkpoint_save" in f.summary and "learned" in f.summary
    # the same 8 s save on a job that has shown no save yet: the 30 s default
    assert hang.detect(saving(8.0), History(), CFG) == []
    # steps that include the saves' blocking (1.5 s) make a 15 s step budget: it is the
    # save's budget only until saves were learned
    slow_steps = tuple(dataclasses.replace(s, step_seconds=1.5 if s.step % 10 == 0 else 0.1)
                       for s in trainee)  # fmt: skip
    blocked = at(0, *[rank(n, phase="checkpoint_save", step=30, age=8.0, recent=slow_steps)
                      for n in (0, 1)])  # fmt: skip
    [f] = hang.detect(blocked, learned, CFG)
    assert f.evidence["budget"]["seconds"] == pytest.approx(7.35)
    assert f.evidence["train_budget_seconds"] == pytest.approx(15.0, rel=0.01)
    assert hang.detect(blocked, History(), CFG) == []  # nothing learned: the 30 s default


def stopped(r, since, **kw):
    return dataclasses.replace(rank(r, **kw), state="stopped", state_since=T0 - since)


def test_a_stopped_rank_in_start_up_is_hung_after_the_confirmation_window():
    # rank 1 stopped during checkpoint load; its budget (120 s default) is far away
    peer = rank(0, phase="checkpoint_load", age=1.0, restart=2)
    assert hang.detect(at(0, peer, stopped(1, 1.0, phase="checkpoint_load", restart=2)),
                       History(), CFG) == []  # fmt: skip
    [f] = hang.detect(
        cluster(peer, stopped(1, 1.6, phase="checkpoint_load", restart=2)), History(), CFG
    )
    assert f.rank == 1 and f.evidence["decided_by"] == "stopped"
    assert f.evidence["hung_phase"] == "checkpoint_load" and f.occurred_at == T0 - 1.6
    assert "stopped" in f.evidence["culprit_reason"] and not f.evidence["stacks_needed"]
    # init, before any telemetry from the peer's side of the collective: still caught
    [f] = hang.detect(cluster(rank(0, phase="init"), stopped(1, 2.0, phase="init")), History(), CFG)
    assert f.evidence["hung_phase"] == "init"


def test_every_rank_stopped_is_a_suspend_and_never_a_hang():
    both = cluster(
        stopped(0, 30.0, age=30.0, recent=samples(1, 30)),
        stopped(1, 30.0, age=30.0, recent=samples(1, 30)),
    )
    assert hang.detect(both, History(), CFG) == []
    # just after SIGCONT: the ranks are alive but silent for 30 s; the time suspended does
    # not count, and neither does a rank stopped a moment longer than its peer
    h = History(phases=PhaseTrace(suspended_at={"j": T0 - 0.5}))
    resumed = cluster(*[rank(n, age=30.0, recent=samples(1, 30)) for n in (0, 1)])
    assert hang.detect(resumed, h, CFG) == []
    last = cluster(rank(0, age=0.1, recent=samples(1, 30)),
                   stopped(1, 30.0, age=30.0, recent=samples(1, 30)))  # fmt: skip
    assert hang.detect(last, h, CFG) == []
    # ... and later the usual rules apply again
    h = History(phases=PhaseTrace(suspended_at={"j": T0 - 20.0}))
    assert len(hang.detect(cluster(*[rank(n, age=5.0, recent=samples(1, 30)) for n in (0, 1)]),
                           h, CFG)) == 1  # fmt: skip


def test_a_rank_idle_behind_its_peers_is_hung_without_a_budget():
    def behind(idle, silent):
        slow = dataclasses.replace(
            rank(1, phase="checkpoint_load", age=silent), cpu_active_at=T0 - idle
        )
        return cluster(rank(0, phase="train", age=0.2, step=20), slow)

    [f] = hang.detect(behind(idle=2.0, silent=3.0), History(), CFG)
    assert f.rank == 1 and f.evidence["decided_by"] == "idle behind its peers"
    assert f.evidence["hung_phase"] == "checkpoint_load"
    # busy (reading a large checkpoint) or beating (progress heartbeats): not hung
    assert hang.detect(behind(idle=0.5, silent=3.0), History(), CFG) == []
    assert hang.detect(behind(idle=2.0, silent=0.5), History(), CFG) == []
    # a peer out of view (world of 3) may be behind too: no verdict
    three = [dataclasses.replace(r, world_size=3) for r in behind(2.0, 3.0).ranks()]
    assert hang.detect(cluster(*three), History(), CFG) == []


def test_phases_table_is_type_checked_with_the_key_named(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[detectors.hang.phases]\ncheckpoint_load = 30\nconfirm_seconds = 2.0\n")
    cfg = sup_config.load(path).detectors.hang.phases
    assert (cfg.checkpoint_load, cfg.confirm_seconds, cfg.init) == (30.0, 2.0, 120.0)
    path.write_text('[detectors.hang.phases]\ninit = "2m"\n')
    with pytest.raises(SettingsError, match="detectors.hang.phases.init: expected a number"):
        sup_config.load(path)
    path.write_text("[detectors.hang.phases]\nmargin = 0\n")
    with pytest.raises(SettingsError, match="margin must be > 0"):
        sup_config.load(path)
    with pytest.raises(ValueError):
        PhaseBudgetConfig(quantile=0.0)


def _dump(main: list[str], save: list[str]) -> str:
    """A py-spy dump of a trainer: its main thread's and its save thread's frames, each a
    "function (file:line)" line."""
    lines = ['Thread 100 (idle): "MainThread"', *[f"    {f}" for f in main]]
    lines += ['Thread 101 (idle): "rankguard-ckpt_0"', *[f"    {f}" for f in save]]
    return "\n".join(lines) + "\n"


def test_a_stuck_save_is_blamed_on_the_rank_whose_save_thread_is_not_in_a_collective():
    waiting = [  # the trainer waits for its save
        "Condition.wait (threading.py:327)",
        "Future.result (concurrent/futures/_base.py:451)",
        "AsyncCheckpointer.wait (rankguard/trainer/checkpoint.py:291)",
        "train_step (rankguard/trainer/train.py:238)",
    ]
    save = ["_finish (rankguard/trainer/checkpoint.py:242)",
            "_write_and_finish (rankguard/trainer/checkpoint.py:200)",
            "_WorkItem.run (concurrent/futures/thread.py:58)"]  # fmt: skip
    gathering = ["all_gather_object (torch/distributed/distributed_c10d.py:2426)", *save]
    asleep = ["_finish (rankguard/trainer/checkpoint.py:231)", *save[1:]]  # slow storage
    stacks = {0: _dump(waiting, gathering), 1: _dump(waiting, asleep)}
    assert hang.pick_culprit_from_stacks(stacks) == 1
    # both save threads in the collective, or dumps without save threads: no verdict
    both = {0: stacks[0], 1: stacks[0]}
    assert hang.pick_culprit_from_stacks(both) is None
    plain = {r: 'Thread 1 (idle): "MainThread"\n    wait (a.py:1)\n' for r in (0, 1)}
    assert hang.pick_culprit_from_stacks(plain) is None


def test_a_restarted_incarnation_keeps_the_last_settled_ones_step_times_until_it_settles():
    """CI's partition test: after the restart, 5 steps of 0.16 s made a 1.6 s budget and
    a 1.8 s stall of two busy ranks on a loaded host was killed as a hang. The job's
    earlier steps (0.9 s) still bound the budget until the new incarnation settles."""
    before = [rank(n, step=40, recent=samples(1, 40, seconds=0.9)) for n in (0, 1)]
    h = step_through([at(0, *before)])
    assert h.phases.settled_steps["j"][0] == 0

    def restarted(last, age):
        window = samples(31, last, restart=1, seconds=0.15)
        return at(5, *[rank(n, restart=1, step=last, age=age, recent=window) for n in (0, 1)])

    young = restarted(35, 1.8)
    [alone] = hang.detect(young, History(), CFG)  # with no history: 10 x 0.15 s
    assert alone.evidence["budget"]["source"] == "steps"
    h = step_through([young], h)  # a young incarnation leaves the settled one in place
    assert h.phases.settled_steps["j"][0] == 0
    assert hang.detect(young, h, CFG) == []
    [f] = hang.detect(restarted(35, 9.5), h, CFG)
    assert f.evidence["budget"]["source"] == "earlier steps"
    assert f.evidence["train_budget_seconds"] == pytest.approx(9.0)
    assert f.evidence["earlier_sample_count"] == 80 and "settled" in f.summary
    # settled (20 steps): its own step times alone decide, and it becomes the one kept
    settled = restarted(31 + P.settled_steps, 1.8)
    [f] = hang.detect(settled, h, CFG)
    assert f.evidence["budget"]["source"] == "steps" and f.evidence["earlier_sample_count"] == 0
    assert step_through([settled], h).phases.settled_steps["j"][0] == 1
