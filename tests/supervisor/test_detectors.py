"""Detectors: pure functions of literal observations. No processes, sockets or clocks."""

from __future__ import annotations

import dataclasses
import logging
import math
import random

import pytest
from builders import CFG, T0, cluster, hung, nodeobs, rank, sample, samples, trained

from rankguard.contract.answers import RankGpuAnswer
from rankguard.supervisor import model, policy
from rankguard.supervisor.detectors import (
    DETECTORS,
    DetectorConfig,
    advance_history,
    checkpoint,
    dead,
    hang,
    node,
    numerics,
    pick_culprit_from_stacks,
    run_all,
    straggler,
    unreachable,
)
from rankguard.supervisor.model import History
from rankguard.supervisor.state import ClusterObs, NodeObs

# -- literal observations ---------------------------------------------------------------


def kinds(findings):
    return [f.kind for f in findings]


# -- config and run_all ---------------------------------------------------------------------


def test_config_defaults_and_validation():
    assert CFG.hang.floor_seconds == 1.0 and CFG.straggler.window == 12
    assert CFG.numerics.spike_min_samples == 20 and CFG.unreachable.grace_seconds == 3.0
    for section, bad in (
        (hang.HangConfig, {"quantile": 0.0}),
        (hang.HangConfig, {"quantile": 1.5}),
        (hang.HangConfig, {"floor_seconds": -1.0}),
        (straggler.StragglerConfig, {"window": 1}),
        (straggler.StragglerConfig, {"window": 2.5}),
        (numerics.NumericsConfig, {"spike_min_ratio": 0.5}),
        (checkpoint.CheckpointConfig, {"stale_factor": 0}),
        (hang.HangConfig, {"warmup_seconds": math.nan}),
        (hang.HangConfig, {"idle_cpu_cores": 0.6}),
        (unreachable.UnreachableConfig, {"grace_seconds": "3"}),
    ):
        with pytest.raises(ValueError):
            section(**bad)


def test_a_detector_turned_off_reports_nothing():
    lost = {"code": "gpu_lost", "severity": "unhealthy", "message": "GPU 1 is lost"}
    obs = ClusterObs(T0, (nodeobs(name="gpu7", reasons=[lost], status="unhealthy"),))
    off = DetectorConfig(node=node.NodeConfig(enabled=False))
    assert run_all(obs, History(), CFG) != []
    assert run_all(obs, History(), off) == []


def test_run_all_clean_cluster_is_quiet():
    obs = cluster(*trained(4, ckpt=20))
    assert run_all(obs, History(), CFG) == []


def test_a_raising_detector_does_not_stop_the_others(caplog):
    def broken(obs, history, cfg):
        raise RuntimeError("bug")

    obs = cluster(rank(0, state="exited", exited_at=T0 - 1), rank(1))
    with caplog.at_level(logging.ERROR):
        found = run_all(obs, History(), CFG, detectors=[("broken", broken), *DETECTORS])
    assert kinds(found) == [model.RANK_DEAD]
    assert "broken" in caplog.text


# -- dead -----------------------------------------------------------------------------------


def test_a_zero_code_workers_death_says_no_step_was_reported():
    obs = cluster(rank(0, step=None, phase=None),
                  rank(1, state="exited", exited_at=T0 - 1, step=None, phase=None))  # fmt: skip
    [f] = dead.detect(obs, History(), CFG)
    assert "(pid 1001, no step reported, restart 0)" in f.summary, f.summary
    assert f.evidence["step"] is None  # stored as unknown, not as step 0
    # its watch counted its optimizer's steps: named, and stored
    obs = cluster(rank(0, step=None, phase=None, script_step=41),
                  rank(1, state="exited", exited_at=T0 - 1, step=None, phase=None,
                       script_step=40))  # fmt: skip
    [f] = dead.detect(obs, History(), CFG)
    assert "(pid 1001, step 40 (its optimizer's count), restart 0)" in f.summary, f.summary
    assert f.evidence["step"] == 40


def test_dead_rank_reported_with_exit_time_and_evidence():
    obs = cluster(rank(0), rank(1, state="exited", exited_at=T0 - 2, step=7, phase="train"))
    [f] = dead.detect(obs, History(), CFG)
    assert (f.kind, f.severity, f.rank, f.node) == (model.RANK_DEAD, "critical", 1, "n0")
    assert f.key == "rank_dead:j:0"
    assert f.occurred_at == T0 - 2
    assert f.evidence == {
        "state": "exited",
        "exit_code": None,  # the agent read no waitpid status (the process was reaped)
        "pid": 1001,
        "step": 7,
        "phase": "train",
        "restart": 0,
        "node_url": "http://n0:9400",
        "dead_ranks": {"1": {"state": "exited", "exited_at": T0 - 2}},
    }
    [z] = dead.detect(cluster(rank(0, state="zombie", exited_at=T0)), History(), CFG)
    assert z.evidence["state"] == "zombie"


def test_a_dead_rank_names_its_gpus_fault():
    """The rank's GPU, tied by UUID: a new XID there explains the death; a healthy GPU is
    in the evidence and not in the summary."""
    bad = RankGpuAnswer("GPU-0000aaaa-1111", "reported", index=3, xid_recent={"79": 1})
    dying = dataclasses.replace(rank(1, state="exited", exited_at=T0 - 2), gpu=bad)
    [f] = dead.detect(cluster(rank(0), dying), History(), CFG)
    assert f.summary.endswith(
        "; its GPU GPU-0000aaaa-1111 (index 3): XID 79 x1 in the last 10 min"
    ), f.summary
    assert f.evidence["gpu"]["xid_recent"] == {"79": 1}
    healthy = dataclasses.replace(dying, gpu=RankGpuAnswer("GPU-0000aaaa-1111", "nvml", index=3))
    [g] = dead.detect(cluster(rank(0), healthy), History(), CFG)
    assert "its GPU" not in g.summary and g.evidence["gpu"]["source"] == "nvml"


def test_finished_ranks_and_earlier_incarnations_are_not_dead():
    finished = cluster(rank(0, state="finished", phase="done"), rank(1, state="finished"))
    assert dead.detect(finished, History(), CFG) == []
    # restart 0's processes were ended by torchrun; restart 1 runs
    restarted = cluster(
        rank(0, state="exited", exited_at=T0 - 9),
        rank(1, state="exited", exited_at=T0 - 9),
        rank(0, restart=1),
        rank(1, restart=1),
    )
    assert dead.detect(restarted, History(), CFG) == []
    # rank 1's new process has not reported yet: its old one is not news either
    half = cluster(rank(0, restart=1), rank(1, state="exited", exited_at=T0 - 9))
    assert dead.detect(half, History(), CFG) == []


def test_dead_key_is_stable_across_polls_and_new_after_restart():
    def poll(t, restart):
        return cluster(
            rank(0, restart=restart), rank(1, restart=restart, state="exited", exited_at=T0), time=t
        )

    a = dead.detect(poll(T0 + 1, 0), History(), CFG)[0].key
    b = dead.detect(poll(T0 + 5, 0), History(), CFG)[0].key
    c = dead.detect(poll(T0 + 9, 1), History(), CFG)[0].key
    assert a == b != c == "rank_dead:j:1"


def test_a_death_restarted_from_between_two_polls_is_still_reported():
    # the last poll saw restart 0 running; by this one rank 1 died and torchrun restarted
    obs = cluster(
        rank(0, state="exited", exited_at=T0 - 1),
        rank(1, state="exited", exited_at=T0 - 2),
        rank(0, restart=1),
        rank(1, restart=1),
    )
    seen_running = History(restarts_before={"j": 0}, restarts={"j": 1})
    [f] = dead.detect(obs, seen_running, CFG)
    assert (f.key, f.rank, f.occurred_at) == ("rank_dead:j:0", 1, T0 - 2)
    # once the new incarnation was seen current, the old one is not news again
    assert dead.detect(obs, History(restarts_before={"j": 1}, restarts={"j": 1}), CFG) == []
    # an incarnation replaced with no dead ranks in view (forgotten, or all finished)
    clean = cluster(rank(0, state="finished", restart=0), rank(0, restart=1))
    assert dead.detect(clean, seen_running, CFG) == []


def test_history_remembers_the_incarnation_of_the_last_poll():
    first = advance_history(History(), cluster(rank(0), rank(1)), CFG)
    assert (first.restarts_before, first.restarts) == ({}, {"j": 0})
    second = advance_history(first, cluster(rank(0, restart=1), rank(1, restart=1)), CFG)
    assert (second.restarts_before, second.restarts) == ({"j": 0}, {"j": 1})
    # a job out of view (its node unreachable) keeps its last incarnation
    third = advance_history(second, cluster(), CFG)
    assert third.restarts == {"j": 1}


def test_the_first_rank_to_die_is_the_one_reported():
    # rank 1 died first; torchrun then ended rank 0: one fault, one finding
    obs = cluster(
        rank(0, state="exited", exited_at=T0 - 1), rank(1, state="exited", exited_at=T0 - 2)
    )
    [f] = dead.detect(obs, History(), CFG)
    assert f.rank == 1 and set(f.evidence["dead_ranks"]) == {"0", "1"}


# -- hang: budgets --------------------------------------------------------------------------


def test_train_budget_learns_from_the_job_with_floor_and_warmup():
    assert hang.train_budget([0.1] * 4, CFG) == (60.0, None)  # warm-up
    budget, q = hang.train_budget([0.05] * 50, CFG)
    assert budget == 1.0 and q == pytest.approx(0.05)  # floor
    budget, _ = hang.train_budget([2.0] * 50, CFG)
    assert budget == pytest.approx(20.0)
    # the first start's defaults (nothing learned): tests/supervisor/test_phase_budgets.py
    assert hang.phase_budget("init", 3.0, CFG).seconds == 120.0
    assert hang.phase_budget("checkpoint_load", 3.0, CFG).seconds == 120.0
    assert hang.phase_budget("first_step", 3.0, CFG).seconds == 60.0
    assert hang.phase_budget("checkpoint_save", 3.0, CFG).seconds == 30.0
    assert hang.phase_budget("checkpoint_save", 45.0, CFG).seconds == 45.0
    assert hang.phase_budget("eval", 3.0, CFG).seconds == 300.0
    assert hang.phase_budget("done", 3.0, CFG).seconds == math.inf


def test_healthy_and_slow_phases_are_not_hangs():
    assert hang.detect(cluster(*trained(2)), History(), CFG) == []
    # 20 s into a checkpoint save: inside its 30 s floor, whatever the others show
    saving = hung(2, age=20.0)
    saving[0] = dataclasses.replace(saving[0], phase="checkpoint_save")
    assert hang.detect(cluster(*saving), History(), CFG) == []
    both_saving = [dataclasses.replace(r, phase="checkpoint_save") for r in hung(2, age=20.0)]
    assert hang.detect(cluster(*both_saving), History(), CFG) == []
    # first step (compilation): no samples yet, 40 s is within the warm-up budget
    first = [rank(r, step=0, age=40.0) for r in range(2)]
    assert hang.detect(cluster(*first), History(), CFG) == []
    assert (
        hang.detect(cluster(*[rank(r, phase="init", age=100.0) for r in range(2)]), History(), CFG)
        == []
    )
    assert (
        hang.detect(cluster(*[rank(r, phase="eval", age=200.0) for r in range(2)]), History(), CFG)
        == []
    )
    assert (
        hang.detect(
            cluster(*[dataclasses.replace(r, phase="done") for r in hung(2, age=999)]),
            History(),
            CFG,
        )
        == []
    )
    # samples of an earlier incarnation do not count: restart 1 is still warming up
    old = [
        dataclasses.replace(r, restart=1, heartbeat_age_seconds=40.0, step=20)
        for r in trained(2, steps=30)
    ]
    assert hang.detect(cluster(*old), History(), CFG) == []


def test_first_step_past_the_warmup_budget_is_a_hang():
    [f] = hang.detect(cluster(*[rank(r, step=0, age=61.0) for r in range(2)]), History(), CFG)
    assert (
        f.evidence["budgets"] == {"first_step": 60.0} and f.evidence["hung_phase"] == "first_step"
    )
    assert f.evidence["sample_count"] == 0 and f.evidence["p99_step_seconds"] is None


def test_no_hang_while_a_rank_still_progresses_or_is_dead():
    ranks = hung(2)
    ranks[1] = dataclasses.replace(ranks[1], heartbeat_age_seconds=0.05)
    assert hang.detect(cluster(*ranks), History(), CFG) == []
    ranks[1] = dataclasses.replace(ranks[1], state="exited", exited_at=T0 - 10)
    assert hang.detect(cluster(*ranks), History(), CFG) == []  # the dead detector's business


def test_survivors_stuck_behind_a_dead_rank_restart_the_job_through_one_of_them():
    """A rank died and the others wait for it (NCCL's survivors spin until the watchdog;
    a survivor whose node's launcher was stopped waits for good): past their budget after
    the death, the job restarts through the lowest live rank; the dead rank is the culprit,
    already reported, and none is named here."""
    ranks = hung(3, age=12.0)
    ranks[2] = dataclasses.replace(ranks[2], state="exited", state_since=T0 - 5.0)
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    ev = f.evidence
    assert f.rank is None and ev["decided_by"] == "survivors of a death", f
    assert ev["dead_ranks"] == [2] and ev["restart_via"]["rank"] == 0, ev
    assert ev["restart_via"]["pid"] == ranks[0].pid and ev["stacks_needed"] is False
    assert "waiting for dead rank(s) 2" in f.summary, f.summary
    [decision] = policy.decide([f], policy.PolicyView(), policy.PolicyConfig(), T0)
    assert decision.action == model.ACT_KILL_RANK and decision.target["rank"] == 0, decision
    # a death just now: torchrun and the peers' failing collectives get their chance first
    ranks[2] = dataclasses.replace(ranks[2], state_since=T0 - 0.5)
    assert hang.detect(cluster(*ranks), History(), CFG) == []
    # a survivor still reporting is not stuck
    ranks[2] = dataclasses.replace(ranks[2], state_since=T0 - 5.0)
    ranks[1] = dataclasses.replace(ranks[1], heartbeat_age_seconds=0.05)
    assert hang.detect(cluster(*ranks), History(), CFG) == []


def test_hang_finding_evidence_and_occurred_at():
    ranks = hung(3, age=12.0)
    ranks[2] = dataclasses.replace(ranks[2], heartbeat_age_seconds=10.0)
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert (f.kind, f.severity, f.key) == (model.RANK_HUNG, "critical", "rank_hung:j:0:30")
    assert f.occurred_at == T0 - 10.0
    ev = f.evidence
    assert ev["budgets"] == {"train": 1.0} and ev["p99_step_seconds"] == pytest.approx(0.1)
    assert ev["sample_count"] == 90 and ev["steps"] == {"0": 30, "1": 30, "2": 30}
    assert ev["heartbeat_ages"]["2"] == 10.0 and ev["states"]["0"] == "alive"
    assert ev["phase"] == "train" and ev["stacks_needed"] is True and f.rank is None
    assert "stacks needed" in ev["culprit_reason"]


def test_hang_behind_an_unreachable_agent_restarts_through_a_reachable_rank():
    """A partition: 2 of 3 ranks in view, all waiting, the third's agent unreachable. No
    stack can name a culprit out of reach: the finding says so and names a reachable rank
    to end, so torchrun re-forms the job without the cut-off node."""
    seen = [dataclasses.replace(r, world_size=3) for r in hung(2, age=12.0)]
    down = NodeObs.unreachable("http://n2:9400", "timed out", T0, node="n2")
    [f] = hang.detect(cluster(*seen, nodes=(down,)), History(), CFG)
    ev = f.evidence
    assert f.rank is None and ev["stacks_needed"] is False
    assert (ev["missing_ranks"], ev["unreachable_nodes"]) == (1, ["n2"])
    assert ev["restart_via"]["rank"] == 0 and ev["restart_via"]["pid"] == seen[0].pid
    assert "unreachable" in ev["culprit_reason"]
    # a lower step in view says nothing about the ranks out of view: still the partition
    lower = [seen[0], dataclasses.replace(seen[1], step=29)]
    [f] = hang.detect(cluster(*lower, nodes=(down,)), History(), CFG)
    assert f.rank is None and f.evidence["missing_ranks"] == 1, f.evidence
    # every rank in view, or every agent reachable: an ordinary hang, stacks needed
    [f] = hang.detect(cluster(*seen), History(), CFG)
    assert "restart_via" not in f.evidence and f.evidence["stacks_needed"] is True
    [f] = hang.detect(cluster(*hung(2, age=12.0), nodes=(down,)), History(), CFG)
    assert "restart_via" not in f.evidence


# -- hang: culprits -------------------------------------------------------------------------


def test_stopped_rank_is_the_culprit_even_within_its_own_budget():
    ranks = hung(3)
    ranks[1] = dataclasses.replace(ranks[1], state="stopped", heartbeat_age_seconds=1.0)
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 1 and "stopped" in f.evidence["culprit_reason"]
    assert f.evidence["pid"] == 1001 and f.evidence["node_url"] == "http://n0:9400"
    assert f.evidence["stacks_needed"] is False
    # the others are still inside their budget: not yet
    ranks = [dataclasses.replace(r, heartbeat_age_seconds=1.0) for r in ranks]
    assert hang.detect(cluster(*ranks), History(), CFG) == []


def test_lower_step_rank_is_the_culprit():
    ranks = hung(4)
    ranks[2] = dataclasses.replace(ranks[2], step=29)
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 2 and f.key == "rank_hung:j:0:29"
    assert "behind" in f.evidence["culprit_reason"]
    # two ranks behind: telemetry cannot tell which
    ranks[3] = dataclasses.replace(ranks[3], step=29)
    assert hang.detect(cluster(*ranks), History(), CFG)[0].rank is None


def test_spinning_rank_is_the_culprit_when_it_stands_out():
    ranks = [dataclasses.replace(r, cpu_utilization=0.02) for r in hung(3)]
    ranks[0] = dataclasses.replace(ranks[0], cpu_utilization=0.98)
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 0 and "busy" in f.evidence["culprit_reason"]
    # everyone busy (NCCL ranks spin while they wait): no standout
    busy = [dataclasses.replace(r, cpu_utilization=1.0) for r in ranks]
    assert hang.detect(cluster(*busy), History(), CFG)[0].rank is None
    # an unknown figure: no standout either
    ranks[1] = dataclasses.replace(ranks[1], cpu_utilization=None)
    assert hang.detect(cluster(*ranks), History(), CFG)[0].rank is None


def test_hang_key_stable_across_polls_and_new_after_restart():
    def poll(age, restart=0, steps=30):
        ranks = hung(2, age=age, steps=steps, restart=restart)
        ranks = [dataclasses.replace(r, recent=samples(1, steps, restart=restart)) for r in ranks]
        return hang.detect(cluster(*ranks, time=T0 + age), History(), CFG)[0]

    a, b = poll(10.0), poll(25.0)
    assert a.key == b.key == "rank_hung:j:0:30"
    assert a.occurred_at == b.occurred_at == T0  # the last progress, not the poll
    assert poll(10.0, restart=1, steps=12).key == "rank_hung:j:1:12"


# A real `py-spy dump` of the bundled trainer: the culprit sleeps in the fault injector,
# the others wait in DDP's all-reduce (inside backward). Non-main threads wait too.
WAITING = """\
Process 4242: /usr/bin/python3 -m rankguard.trainer --job demo
Python v3.11.9 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:768)
    backward (torch/autograd/__init__.py:289)
    Tensor.backward (torch/_tensor.py:521)
    train_step (rankguard/trainer/train.py:238)
    run (rankguard/trainer/train.py:292)
    main (rankguard/trainer/__main__.py:41)
    <module> (rankguard/trainer/__main__.py:60)
    _run_code (runpy.py:88)
    _run_module_as_main (runpy.py:198)
Thread 4301 (idle): "Thread-1 (_writer)"
    Condition.wait (threading.py:327)
    Queue.get (queue.py:171)
    _writer (rankguard/trainer/checkpoint.py:120)
"""

SLEEPING = """\
Process 4243: /usr/bin/python3 -m rankguard.trainer --job demo
Python v3.11.9 (/usr/bin/python3.11)

Thread 4243 (idle+gil): "MainThread"
    at_step_start (rankguard/trainer/faults.py:105)
    train_step (rankguard/trainer/train.py:220)
    run (rankguard/trainer/train.py:292)
    main (rankguard/trainer/__main__.py:41)
    <module> (rankguard/trainer/__main__.py:60)
Thread 4302 (idle): "Thread-1 (_writer)"
    Condition.wait (threading.py:327)
    Queue.get (queue.py:171)
    _writer (rankguard/trainer/checkpoint.py:120)
"""


def test_stacks_pick_the_rank_outside_the_collective():
    assert pick_culprit_from_stacks({0: WAITING, 1: SLEEPING, 2: WAITING, 3: WAITING}) == 1
    assert [f.function for f in hang.main_thread_frames(SLEEPING)[:2]] == [
        "at_step_start",
        "train_step",
    ]


def test_stacks_ambiguous_or_unreadable_give_no_culprit():
    assert pick_culprit_from_stacks({0: WAITING, 1: WAITING}) is None  # all waiting
    assert pick_culprit_from_stacks({0: SLEEPING, 1: SLEEPING, 2: WAITING}) is None  # two
    failed = "Error: Failed to find python version from target process"
    assert pick_culprit_from_stacks({0: failed, 1: WAITING, 2: WAITING}) is None
    assert pick_culprit_from_stacks({}) is None


def _simulated_run(hang_at=None):
    """(time, phase, step, step_seconds) records of one rank of a healthy run: start-up,
    a 40 s first step (compilation), 0.1 s steps, a checkpoint every 50 steps whose
    staging blocks 2 s, one slow 25 s save, then done. With `hang_at`, records stop
    after that step (the rank hangs, so does everyone)."""
    recs, t = [(0.0, "init", 0, 0.0), (8.0, "train", 0, 0.0)], 8.0
    for step in range(1, 201):
        seconds = 40.0 if step == 1 else 0.1
        if step % 50 == 0:
            recs.append((t + 0.1, "checkpoint_save", step, 0.0))
            seconds += 25.0 if step == 100 else 2.0
        t += seconds
        recs.append((t, "train", step, seconds))
        if step == hang_at:
            return recs, t
    recs.append((t + 1.0, "checkpoint_save", 200, 0.0))
    recs.append((t + 6.0, "done", 200, 0.0))
    return recs, t + 6.0


def _obs_at(now, recs, world=2):
    seen = [r for r in recs if r[0] <= now]
    last = seen[-1]
    timed = [sample(s, phase="train", seconds=sec) for (_, ph, s, sec) in seen if sec > 0][-64:]
    ranks = [
        rank(r, step=last[2], phase=last[1], age=now - last[0], recent=timed, world=world)
        for r in range(world)
    ]
    return cluster(*ranks, time=T0 + now)


def test_a_clean_simulated_run_never_looks_hung():
    recs, end = _simulated_run()
    now = 0.0
    while now < end + 30:
        assert hang.detect(_obs_at(now, recs), History(), CFG) == [], now
        now += 0.5


def test_a_simulated_hang_is_caught_in_seconds():
    recs, stopped = _simulated_run(hang_at=180)
    now, caught = stopped, None
    while caught is None and now < stopped + 600:
        now += 0.5
        caught = hang.detect(_obs_at(now, recs), History(), CFG) or None
    # the last 64 steps include the 2 s staging steps, hence the 10x of ~2 s
    assert caught is not None and now - stopped <= 25.0
    assert caught[0].key == "rank_hung:j:0:180"


# -- straggler ------------------------------------------------------------------------------


def _steps_for(n, *, compute=0.07, comm=0.02, restart=0):
    return tuple(sample(s, compute=compute, comm=comm, restart=restart) for s in range(1, n + 1))


NO_WARMUP = dataclasses.replace(CFG, straggler=dataclasses.replace(CFG.straggler, warmup_steps=0))


def _stragglers(ranks, cfg=NO_WARMUP):
    """The straggler condition on one observation (persistence is tested on its own)."""
    return straggler.suspects(cluster(*ranks), cfg, History())


def test_straggler_with_slower_compute_and_waiting_peers():
    ranks = [rank(r, recent=_steps_for(30, comm=0.034)) for r in range(4)]
    ranks[2] = rank(2, recent=_steps_for(30, compute=0.084, comm=0.02))  # +20%
    [f] = _stragglers(ranks)
    assert (f.kind, f.severity, f.rank) == (model.STRAGGLER, "warning", 2)
    assert f.key == "straggler:j:2:0"
    assert f.evidence["ratio"] == pytest.approx(1.2)
    assert f.evidence["window"] == 12 and f.evidence["peers_median_comm_seconds"] > 0.03


def test_a_rank_still_slower_under_the_threshold_is_held_not_named():
    """1.10x: under the 1.15x threshold and too little excess, so no finding, but still
    slower than its peers: its incident, once open, stays open. 1.0x: not held."""
    ranks = [rank(r, recent=_steps_for(30, comm=0.034)) for r in range(4)]
    ranks[2] = rank(2, recent=_steps_for(30, compute=0.077, comm=0.02))
    found, _, slower = straggler.judge(cluster(*ranks), NO_WARMUP, History())
    assert found == [] and slower == {"straggler:j:2:0"}
    h = advance_history(History(), cluster(*ranks), NO_WARMUP)
    assert straggler.holds(h) == {"straggler:j:2:0"}
    even = [rank(r, recent=_steps_for(30, comm=0.034)) for r in range(4)]
    assert straggler.judge(cluster(*even), NO_WARMUP, History())[2] == frozenset()


def test_straggler_needs_corroboration_a_full_window_and_two_ranks():
    slow_no_wait = [rank(0, recent=_steps_for(30)), rank(1, recent=_steps_for(30, compute=0.09))]
    assert _stragglers(slow_no_wait) == []  # peers do not wait longer in comm
    short = [
        rank(0, recent=_steps_for(30, comm=0.04)),
        rank(1, recent=_steps_for(11, compute=0.09)),
    ]
    assert _stragglers(short) == []
    assert _stragglers([rank(0, recent=_steps_for(30, compute=0.5))]) == []


def test_straggler_ignores_non_train_phases_and_earlier_incarnations():
    base = [rank(r, recent=_steps_for(30, comm=0.03)) for r in range(3)]
    evals = tuple(dataclasses.replace(s, phase="eval", compute_seconds=0.5) for s in _steps_for(30))
    base[1] = rank(1, recent=base[1].recent + evals)
    assert _stragglers(base) == []
    old = [
        rank(0, restart=1, recent=_steps_for(30, comm=0.03) + _steps_for(5, restart=1)),
        rank(1, restart=1, recent=_steps_for(30, compute=0.09) + _steps_for(5, restart=1)),
    ]
    assert _stragglers(old) == []


def test_straggler_key_is_one_incident_per_rank_and_incarnation():
    def poll(steps, restart=0):
        fast = _steps_for(steps, comm=0.05, restart=restart)  # they wait for the whole gap
        slow = _steps_for(steps, compute=0.1, restart=restart)
        ranks = [rank(0, restart=restart, recent=fast), rank(1, restart=restart, recent=slow)]
        return _stragglers(ranks)[0].key

    assert poll(25) == poll(35) == "straggler:j:1:0"
    assert poll(25, restart=1) == "straggler:j:1:1"


def test_jitter_never_makes_a_straggler():
    rng = random.Random(1234)
    history = {r: [] for r in range(4)}
    for step in range(1, 501):
        for r in range(4):
            history[r].append(
                sample(
                    step,
                    compute=0.07 * (1 + rng.uniform(-0.05, 0.05)),
                    comm=0.02 * (1 + rng.uniform(-0.05, 0.05)),
                )
            )
        ranks = [rank(r, step=step, recent=history[r][-64:]) for r in range(4)]
        assert _stragglers(ranks) == [], step


# Issue 16: slow or preempted. `wait` is the run-queue wait the client reports in compute.


def _waiting(n, *, compute=0.07, comm=0.02, wait=0.0):
    return tuple(
        dataclasses.replace(s, compute_wait_seconds=wait)
        for s in _steps_for(n, compute=compute, comm=comm)
    )


def test_a_preempted_rank_is_not_a_straggler_but_is_told_apart():
    """Rank 2's compute is 1.2x its peers' only by the time it sat runnable without a CPU:
    its own work is its peers'. Not named; judged preempted, logged once per episode."""
    ranks = [rank(r, recent=_waiting(30, comm=0.034)) for r in range(4)]
    ranks[2] = rank(2, recent=_waiting(30, compute=0.084, wait=0.014))
    assert _stragglers(ranks) == []
    found, [p], slower = straggler.judge(cluster(*ranks), NO_WARMUP, History())
    assert found == [] and (p.rank, p.key) == (2, "straggler:j:2:0")
    assert slower == frozenset()  # preempted is not slower: its incident would not be held
    assert (p.ratio, p.own_ratio) == (pytest.approx(1.2), pytest.approx(1.0))
    assert (p.wait, p.peers_wait) == (pytest.approx(0.014), 0.0)


def test_a_preempted_rank_is_logged_once_per_episode(caplog):
    ranks = [rank(r, recent=_waiting(30, comm=0.034)) for r in range(4)]
    ranks[2] = rank(2, recent=_waiting(30, compute=0.084, wait=0.014))
    h = History()
    with caplog.at_level(logging.INFO, logger="rankguard.supervisor.detectors"):
        for t in (T0, T0 + 1):
            h = advance_history(h, cluster(*ranks, time=t), NO_WARMUP)
    assert caplog.text.count("rank 2 on n0 is preempted, not a straggler") == 1
    assert h.preempted == {"straggler:j:2:0": (T0, 30)} and h.straggler_since == {}


def test_a_slow_rank_without_run_queue_wait_is_named_with_the_waits_in_evidence():
    """Slow but not preempted (a sleep, a slow device): named on its own work. With its
    peers preempted, its raw compute is only 1.05x theirs, under the threshold: judged on
    raw compute it would go unnamed."""
    ranks = [rank(r, recent=_waiting(30, compute=0.08, comm=0.034, wait=0.01)) for r in range(4)]
    ranks[2] = rank(2, recent=_waiting(30, compute=0.084, wait=0.0))
    [f] = _stragglers(ranks)
    assert f.rank == 2 and f.evidence["judged_on"] == "own_work"
    assert f.evidence["ratio"] == pytest.approx(1.2) and f.evidence["raw_ratio"] == pytest.approx(
        1.05
    )
    assert f.evidence["median_compute_wait_seconds"] == 0.0
    assert f.evidence["peers_median_compute_wait_seconds"] == pytest.approx(0.01)
    assert f.evidence["rank_medians"]["0"]["compute_wait"] == pytest.approx(0.01)
    assert "own work" in f.summary
    # the same ranks without the wait field: raw compute, 1.05x, nobody named
    raw = [rank(r.rank, recent=_steps_for(30, compute=r.recent[0].compute_seconds,
                                          comm=r.recent[0].comm_seconds)) for r in ranks]  # fmt: skip
    assert _stragglers(raw) == []


def test_a_rank_without_the_wait_field_makes_the_job_judged_on_raw_compute():
    """An older client among the ranks: the wait is unknown, the job is judged as before
    issue 16, and the preempted-looking rank is named on its raw compute."""
    ranks = [rank(r, recent=_waiting(30, comm=0.034)) for r in range(4)]
    ranks[0] = rank(0, recent=_steps_for(30, comm=0.034))  # no compute_wait_seconds
    ranks[2] = rank(2, recent=_waiting(30, compute=0.084, wait=0.014))
    [f] = _stragglers(ranks)
    assert f.rank == 2 and f.evidence["judged_on"] == "compute"
    assert f.evidence["ratio"] == pytest.approx(1.2) and "raw_ratio" not in f.evidence
    assert straggler.judge(cluster(*ranks), NO_WARMUP, History())[1] == []


def _slowed(factors, *, wait=None):
    """Rank 1's compute at step s is factors[s - 1] x its peers'; its peers wait in
    communication for the gap."""

    def rank_steps(r):
        out = []
        for s, slow in enumerate(factors, start=1):
            factor = slow if r == 1 else 1.0
            comm = 0.02 + (0.0 if r == 1 else 0.07 * max(0.0, slow - 1) + 0.02)
            out.append(dataclasses.replace(sample(s, compute=0.07 * factor, comm=comm),
                                           compute_wait_seconds=wait))  # fmt: skip
        return tuple(out)

    return [rank(r, step=len(factors), recent=rank_steps(r)) for r in range(3)]


def _straggler_cfg(**kw):
    return dataclasses.replace(NO_WARMUP, straggler=dataclasses.replace(NO_WARMUP.straggler, **kw))


def _named_at_once(ranks, cfg=NO_WARMUP):
    """Findings on a first look: only an accumulated excess needs no persistence."""
    return straggler.detect(cluster(*ranks), History(), cfg)


def test_a_slowdown_adds_up_step_by_step_to_the_excess_limit():
    """Issue 16: each step 1.2x slower adds log(1.2) - 0.09; after 31 steps (3.1 s) the sum
    is over the limit of 2.2 and the rank is named without waiting for persistence."""
    [f] = _named_at_once(_slowed([1.0] * 29 + [1.2] * 31))
    assert f.rank == 1 and f.evidence["ratio"] == pytest.approx(1.2)
    assert f.evidence["excess"] == pytest.approx(31 * (math.log(1.2) - 0.09))
    assert f.evidence["excess_seconds"] == pytest.approx(3.1)  # 31 steps of 0.1 s
    assert "excess 2.9 over 3.1s" in f.summary
    # judged on own work the same way when the run-queue wait is known
    [f] = _named_at_once(_slowed([1.0] * 29 + [1.2] * 31, wait=0.0))
    assert f.evidence["judged_on"] == "own_work" and f.evidence["excess"] > 2.2
    # 12 steps: a suspect of the median rule, which waits for its persistence
    [f] = _stragglers(_slowed([1.0] * 48 + [1.2] * 12))
    assert f.evidence["excess"] == pytest.approx(12 * (math.log(1.2) - 0.09))
    assert _named_at_once(_slowed([1.0] * 48 + [1.2] * 12)) == []
    # the sum runs over `lookback_steps` before the window only
    assert _named_at_once(_slowed([1.0] * 29 + [1.2] * 31), _straggler_cfg(lookback_steps=0)) == []


def test_a_flickering_slowdown_is_named_on_its_excess():
    """On CPU the slowed rank's signal flickers: slower on 2 steps of 3, under the median
    rule's consistency of 0.75, but each flicker takes only 0.09 off the sum."""
    ranks = _slowed([1.0] * 24 + [1.3, 1.3, 1.0] * 12)
    [f] = _named_at_once(ranks)
    assert f.rank == 1 and f.evidence["slower_steps_fraction"] < 0.75
    assert f.evidence["excess"] == pytest.approx(12 * (2 * math.log(1.3) - 3 * 0.09))


def test_a_rank_gets_no_credit_for_its_peers_slow_spell():
    """CI's clean 500-step run (session 12): a noisy neighbour slowed rank 0's peer for a
    while (rank 0 at 0.89x), then rank 0 itself (1.22x on 3 steps of 4) for 24 steps. Its
    excess is counted against its peers (1.42), not against its 0.89x (3.6): not named at
    once, and left to the median rule's persistence."""
    ranks = _slowed([0.89] * 24 + [1.22, 1.22, 1.22, 1.0] * 6)
    [f] = _stragglers(ranks)
    assert f.evidence["excess"] == pytest.approx(6 * (3 * math.log(1.22) - 4 * 0.09))
    assert "usual_ratio" not in f.evidence
    assert _named_at_once(ranks) == []


def test_the_excess_counts_each_step_little():
    # a rank back with the pack (1.05x, under the floor of 1.075) is not judged
    assert _stragglers(_slowed([1.0] * 37 + [1.05] * 23)) == []
    # a steady fast rank: nothing
    assert _stragglers(_slowed([0.9] * 60)) == []
    # one very slow step adds at most the cap: 10 steps at 3x are 10 x (0.3 - 0.09)
    [f] = _stragglers(_slowed([1.0] * 50 + [3.0] * 10))
    assert f.evidence["excess"] == pytest.approx(10 * 0.21)
    assert f.evidence["slower_steps_fraction"] >= 0.75  # named by the median rule


# -- numerics -------------------------------------------------------------------------------


def test_nan_in_recent_samples_is_reported_with_its_step_and_checkpoint():
    recent = list(samples(1, 40))
    recent[20] = sample(21, loss=math.nan)
    ranks = [
        rank(0, step=40, recent=samples(1, 40), ckpt=20),
        rank(1, step=40, recent=recent, ckpt=20, age=1.0),
    ]
    [f] = numerics.detect(cluster(*ranks), History(), CFG)
    assert (f.kind, f.severity, f.rank, f.key) == (
        model.BAD_NUMERICS,
        "critical",
        1,
        "bad_numerics:j:0",
    )
    ev = f.evidence
    assert ev["anomaly_step"] == 21 and ev["loss"] == "NaN" and ev["reason"] == "non_finite"
    assert ev["checkpoint_step"] == 20 and ev["checkpoint_predates_anomaly"] is True
    assert f.occurred_at == pytest.approx(T0 - 1.0 - 19 * 0.1)


def test_infinite_latest_loss_and_restart_keys():
    ranks = [rank(0, step=40, loss=math.inf), rank(1, step=40)]
    [f] = numerics.detect(cluster(*ranks), History(), CFG)
    assert f.evidence["anomaly_step"] == 40 and f.evidence["loss"] == "Infinity"
    again = numerics.detect(cluster(*ranks, time=T0 + 5), History(), CFG)[0]
    assert again.key == f.key
    resumed = [rank(0, restart=1, step=40, loss=-math.inf), rank(1, restart=1, step=40)]
    assert numerics.detect(cluster(*resumed), History(), CFG)[0].key == "bad_numerics:j:1"


def test_nan_of_an_earlier_incarnation_is_history():
    recent = samples(1, 20, loss=math.nan) + samples(21, 30, restart=1)
    ranks = [rank(0, restart=1, step=30, recent=recent), rank(1, restart=1, step=30)]
    assert numerics.detect(cluster(*ranks), History(), CFG) == []


def _losses(values, restart=0):
    return tuple(sample(i + 1, loss=v, restart=restart) for i, v in enumerate(values))


def test_loss_spike_fires_only_far_outside_the_recent_range():
    rng = random.Random(7)
    calm = [3.0 + rng.uniform(-0.05, 0.05) for _ in range(30)]
    spiking = rank(1, step=31, loss=9.0, recent=_losses([*calm, 9.0]))
    [f] = numerics.detect(cluster(rank(0, step=31, recent=_losses(calm)), spiking), History(), CFG)
    assert f.evidence["reason"] == "spike" and f.evidence["anomaly_step"] == 31
    assert f.rank == 1 and f.evidence["loss"] == 9.0
    assert f.evidence["median_loss"] == pytest.approx(3.0, abs=0.05)
    # a bump, not a spike
    bump = rank(1, step=31, loss=3.3, recent=_losses([*calm, 3.3]))
    assert numerics.detect(cluster(bump), History(), CFG) == []
    # too few samples to know what normal is
    early = rank(1, step=11, loss=9.0, recent=_losses([*calm[:10], 9.0]))
    assert numerics.detect(cluster(early), History(), CFG) == []


def test_falling_loss_early_in_training_is_not_a_spike():
    falling = [10.0 * 0.9**i for i in range(60)]
    r = rank(0, step=60, loss=falling[-1], recent=_losses(falling)[-64:])
    assert numerics.detect(cluster(r), History(), CFG) == []


# -- node -----------------------------------------------------------------------------------


def test_node_reasons_map_to_findings():
    reasons = [
        {"code": "gpu_lost", "severity": "unhealthy", "message": "GPU 1 is lost"},
        {"code": "xid_79", "severity": "unhealthy", "message": "GPU 0: XID 79 seen 1x"},
        {"code": "xid_79", "severity": "unhealthy", "message": "GPU 3: XID 79 seen 2x"},
        {"code": "xid_13", "severity": "degraded", "message": "GPU 2: XID 13 seen 1x"},
        {"code": "checkpoint_disk_low", "severity": "degraded", "message": "8% free"},
        {"code": "data_disk_low", "severity": "unhealthy", "message": "2% free"},
        {"code": "collector_host_failed", "severity": "degraded", "message": "boom"},
    ]
    obs = ClusterObs(T0, (nodeobs(name="gpu7", reasons=reasons, status="unhealthy"),))
    found = {f.key: f for f in node.detect(obs, History(), CFG)}
    assert sorted(found) == [
        "node_fault:gpu7:checkpoint_disk_low",
        "node_fault:gpu7:data_disk_low",
        "node_fault:gpu7:gpu_lost",
        "node_fault:gpu7:xid_13",
        "node_fault:gpu7:xid_79",
    ]
    lost = found["node_fault:gpu7:gpu_lost"]
    assert (lost.kind, lost.severity, lost.node) == (model.NODE_FAULT, "critical", "gpu7")
    assert lost.evidence["hardware"] is True and lost.evidence["reason"] == reasons[0]
    assert len(found["node_fault:gpu7:xid_79"].evidence["messages"]) == 2
    assert found["node_fault:gpu7:xid_13"].severity == "warning"
    assert found["node_fault:gpu7:xid_13"].evidence["hardware"] is False  # the application's
    disk = found["node_fault:gpu7:checkpoint_disk_low"]
    assert disk.severity == "warning" and disk.evidence["hardware"] is False
    assert found["node_fault:gpu7:data_disk_low"].severity == "critical"


def test_healthy_and_unreachable_nodes_give_no_node_fault():
    down = NodeObs.unreachable("http://n1:9400", "refused", T0)
    obs = ClusterObs(T0, (nodeobs(name="n0"), down))
    assert node.detect(obs, History(), CFG) == []
    for code in ("gpus_missing", "ecc_uncorrected", "xid_48", "xid_79", "nvlink_down",
                 "row_remap_failure", "ib_port_down"):  # fmt: skip
        bad = ClusterObs(T0, (nodeobs(reasons=[{"code": code, "severity": "unhealthy"}]),))
        [f] = node.detect(bad, History(), CFG)
        assert f.evidence["hardware"] is True and f.severity == "critical"
    # the agent's own blindness, a row remap recorded, a contained ECC error: reported only
    for code in ("nvml_unavailable", "xid_63", "xid_94", "xid_12345", "pcie_downtrained",
                 "row_remap_pending", "ib_port_below_rate"):  # fmt: skip
        seen = ClusterObs(T0, (nodeobs(reasons=[{"code": code, "severity": "degraded"}]),))
        [f] = node.detect(seen, History(), CFG)
        assert f.evidence["hardware"] is False and f.severity == "warning", code


def test_a_failing_gpu_names_the_jobs_on_its_node_their_checkpoint_and_step():
    reasons = [
        {"code": "gpu_failing", "severity": "degraded", "message": "GPU 1: 3 remaps pending"}
    ]
    ranks = (rank(0, job="a"), rank(1, job="a", step=11), rank(0, job="b", state="exited"))
    obs = ClusterObs(T0, (nodeobs(*ranks, reasons=reasons, status="degraded"),))
    history = History(checkpoint_progress={"a": (40, 0, T0 - 5), "b": (10, 0, T0 - 50)})
    [f] = node.detect(obs, history, CFG)
    assert (f.key, f.severity, f.evidence["hardware"]) == (
        "node_fault:n0:gpu_failing",
        "warning",
        False,
    )
    # the dead rank's job is not on the node any more: only a, with where it is (the step
    # a save request is computed from: its newest, and its median step time)
    assert f.evidence["jobs"] == {"a": {"checkpoint_step": 40, "checkpoint_seen_at": T0 - 5,
                                        "restart": 0, "step": 11, "step_seconds": 0.1}}  # fmt: skip


# -- unreachable and history ----------------------------------------------------------------

URL = "http://n1:9400"


def _down(t):
    return ClusterObs(t, (nodeobs(name="n0", at=t), NodeObs.unreachable(URL, "timed out", t)))


def _up(t):
    return ClusterObs(t, (nodeobs(name="n0", at=t), nodeobs(name="n1", url=URL, at=t)))


def test_unreachable_after_grace_is_a_monitoring_finding_with_a_stable_key():
    h = History()
    assert unreachable.detect(_down(T0), h, CFG) == []  # first failure: not in history yet
    h = advance_history(h, _down(T0))
    assert h.unreachable_since == {URL: T0}
    assert unreachable.detect(_down(T0 + 2.5), h, CFG) == []  # within grace
    h = advance_history(h, _down(T0 + 2.5))
    assert h.unreachable_since == {URL: T0}  # the first failure is kept
    [f] = unreachable.detect(_down(T0 + 4.0), h, CFG)
    assert (f.kind, f.severity) == (model.AGENT_UNREACHABLE, "warning")
    assert f.evidence["monitoring_only"] is True and f.evidence["error"] == "timed out"
    assert f.evidence["since"] == T0 and f.key == f"agent_unreachable:{URL}:{int(T0)}"
    assert unreachable.detect(_down(T0 + 60.0), h, CFG)[0].key == f.key
    # back, then down again: a new outage, a new key
    h = advance_history(h, _up(T0 + 70))
    assert h.unreachable_since == {}
    assert unreachable.detect(_up(T0 + 70), h, CFG) == []
    h = advance_history(h, _down(T0 + 80))
    assert (
        unreachable.detect(_down(T0 + 90), h, CFG)[0].key
        == f"agent_unreachable:{URL}:{int(T0 + 80)}"
    )


def test_advance_history_tracks_checkpoint_progress_without_mutating():
    h0 = History()
    h1 = advance_history(h0, cluster(*trained(2, steps=25, ckpt=None), time=T0))
    assert h0.checkpoint_progress == {} and h1.checkpoint_progress == {"j": (None, 25, T0)}
    h2 = advance_history(h1, cluster(*trained(2, steps=30, ckpt=20), time=T0 + 5))
    assert h2.checkpoint_progress["j"] == (20, 30, T0 + 5)
    h3 = advance_history(h2, cluster(*trained(2, steps=45, ckpt=20), time=T0 + 9))
    assert h3.checkpoint_progress["j"] == (20, 30, T0 + 5)  # no advance: kept
    # a fresh incarnation that has not reported its checkpoint yet changes nothing
    fresh = [rank(r, restart=1, step=20, ckpt=None) for r in range(2)]
    assert advance_history(h3, cluster(*fresh)).checkpoint_progress["j"] == (20, 30, T0 + 5)
    # a job out of sight this poll keeps its entry
    assert advance_history(h3, ClusterObs(T0 + 20)).checkpoint_progress["j"] == (20, 30, T0 + 5)


# -- checkpoint -----------------------------------------------------------------------------


def test_checkpoint_stale_rule():
    h = History(checkpoint_progress={"j": (100, 101, T0 - 60)})
    assert checkpoint.detect(cluster(*trained(2, steps=400, ckpt=100)), h, CFG) == []
    [f] = checkpoint.detect(cluster(*trained(2, steps=401, ckpt=100)), h, CFG)
    assert (f.kind, f.severity, f.key) == (
        model.CHECKPOINT_STALE,
        "warning",
        "checkpoint_stale:j:100",
    )
    assert f.evidence["steps_since_checkpoint"] == 301 and f.evidence["gap_estimate_steps"] == 100
    assert f.evidence["last_advanced_at"] == T0 - 60 and "gap_estimated_from" in f.evidence
    later = checkpoint.detect(cluster(*trained(2, steps=450, ckpt=100)), h, CFG)
    assert later[0].key == f.key
    # no checkpoint at all yet, or a finished job: nothing to say
    assert checkpoint.detect(cluster(*trained(2, steps=999)), History(), CFG) == []
    done = [dataclasses.replace(r, state="finished") for r in trained(2, steps=999, ckpt=100)]
    assert checkpoint.detect(cluster(*done), h, CFG) == []


def test_straggler_must_persist_and_warmup_is_not_judged():
    def obs(steps, t):
        fast = _steps_for(steps, comm=0.05)
        slow = _steps_for(steps, compute=0.1)
        return cluster(rank(0, recent=fast, step=steps), rank(1, recent=slow, step=steps), time=t)

    # the first 20 steps of an incarnation are warm-up: 30 steps leave too few to judge
    CFG = _straggler_cfg(warmup_steps=20, excess_limit=100.0)  # the median rule alone
    history = advance_history(History(), obs(30, T0 - 1), CFG)
    assert history.incarnation_start == {"j:0": 1}
    assert straggler.suspects(obs(30, T0), CFG, history) == []
    for steps, t in ((40, T0), (45, T0 + 1)):
        history = advance_history(history, obs(steps, t), CFG)
        assert straggler.detect(obs(steps, t), history, CFG) == []  # not yet 10 steps
    history = advance_history(history, obs(50, T0 + 2), CFG)
    assert straggler.detect(obs(50, T0 + 2), history, CFG) == []  # 10 steps, but only 2 s
    history = advance_history(history, obs(52, T0 + 3), CFG)
    [f] = straggler.detect(obs(52, T0 + 3), history, CFG)
    assert f.rank == 1
    # a suspect that stops looking slow is forgotten
    calm = cluster(rank(0, recent=_steps_for(60), step=60), rank(1, recent=_steps_for(60), step=60))
    assert advance_history(history, calm, CFG).straggler_since == {}


def test_an_accumulated_excess_is_named_once_its_steps_took_the_persistence_time():
    """The excess path skips the per-pass persistence (a slowdown that flickers restarts
    it) but not its time: the steps it accumulated over must have taken persist_seconds."""

    def obs(steps, seconds):
        fast = tuple(
            dataclasses.replace(s, step_seconds=seconds) for s in _steps_for(steps, comm=0.05)
        )
        slow = tuple(
            dataclasses.replace(s, step_seconds=seconds) for s in _steps_for(steps, compute=0.1)
        )
        return cluster(rank(0, recent=fast, step=steps), rank(1, recent=slow, step=steps))

    # 1.43x from step 1 on: the excess passes 2.2 after 11 steps, in this one pass
    (f,) = straggler.detect(obs(40, 0.2), History(), NO_WARMUP)  # 40 steps of 0.2 s: 8 s
    assert f.rank == 1 and "excess" in f.summary
    # the same steps at 50 ms: 1.8 s, under persist_seconds (3): the pass persistence rules
    assert straggler.detect(obs(40, 0.05), History(), NO_WARMUP) == []


def test_a_lone_busy_rank_among_idle_ones_is_the_culprit_but_not_one_of_two():
    """Among three or more, the one rank at work while the others sleep in the collective
    is stuck at work. With two, "the busy one" may be an NCCL waiter spinning in a CUDA
    sync beside a culprit asleep: telemetry names no one, the stacks or the recorders do."""
    ranks = [dataclasses.replace(r, cpu_utilization=0.01) for r in hung(3)]
    ranks[1] = dataclasses.replace(ranks[1], cpu_utilization=0.98)
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 1 and "busy at 0.98 cores" in f.evidence["culprit_reason"], f
    two = [
        dataclasses.replace(r, cpu_utilization=c)
        for r, c in zip(hung(2), (0.98, 0.01), strict=True)
    ]
    [f] = hang.detect(cluster(*two), History(), CFG)
    assert f.rank is None and f.evidence["stacks_needed"] is True, f
