"""The incident lifecycle and the cluster verdict: pure functions of literal records.
No processes, sockets, clocks or database."""

from __future__ import annotations

import dataclasses

from rankguard.supervisor.lifecycle import (
    EV_DATA_SKIPPED,
    EV_FIRST_STEP,
    EV_RESTARTED,
    EV_STACKS,
    JobProgress,
    Outcome,
    Transition,
    advance_progress,
    attribute,
    job_state,
    transitions,
)
from rankguard.supervisor.model import Decision, Finding
from rankguard.supervisor.state import ClusterObs, NodeObs, RankObs, StepSample
from rankguard.supervisor.store import Incident
from rankguard.supervisor.views import cluster_verdict

T0 = 1_700_000_000.0


def incident(id=1, kind="rank_hung", state="open", key=None, job="j", **kw) -> Incident:
    values = dict(
        id=id, key=key or f"{kind}:{job}:0:{id}", kind=kind, severity="critical", job=job,
        node="n0", rank=1, summary=f"{kind} {id}", evidence={}, action=None, action_reason=None,
        state=state, detected_at=T0, occurred_at=T0 - 1, acted_at=None, restarted_at=None,
        first_step_at=None, resolved_at=None, restart_before=0, step_at_detect=30,
        checkpoint_step=20, resumed_step=None, lost_steps=None, verdict=None, updated_at=T0,
    )  # fmt: skip
    values.update(kw)
    return Incident(**values)


def finding(kind="rank_hung", key=None, restart=0, job="j", rank=1) -> Finding:
    return Finding(kind, key or f"{kind}:{job}:{restart}", "critical", f"{kind}!", job, "n0",
                   rank, T0, {"restart": restart})  # fmt: skip


def rank(r, *, restart=0, state="alive", step=30, recent=(), source="telemetry", job="j"):
    return RankObs(
        node="n0", job=job, rank=r, world_size=2, pid=1000 + 100 * restart + r,
        restart=restart, state=state, step=step, phase="train", heartbeat_age_seconds=0.1,
        exited_at=None, step_seconds=0.1, compute_seconds=0.07, comm_seconds=0.02,
        comm_compute_ratio=0.3, loss=3.0, checkpoint_step=None, cpu_utilization=None,
        recent=tuple(recent), source=source,
    )  # fmt: skip


def sample(step, restart=0, seconds=0.1):
    return StepSample(step, "train", restart, seconds, 0.07, 0.02, 0.001, 3.0)


def cluster(*ranks, time=T0, reachable=True, status="healthy", reasons=()):
    node = NodeObs(node="n0", url="http://n0:9400", reachable=reachable, observed_at=time,
                   status=status, reasons=tuple(reasons), ranks=tuple(ranks),
                   error=None if reachable else "refused")  # fmt: skip
    return ClusterObs(time=time, nodes=(node,))


def only(moves: list[Transition]) -> Transition:
    (t,) = moves
    return t


# -- outcomes of actions ----------------------------------------------------------------


def test_a_kill_done_starts_the_recovery_and_marks_the_stacks():
    inc = incident(state="acting", action="kill_rank")
    t = only(transitions([inc], [], [Outcome(1, "kill_rank", True, "hung", stacks=True)], [],
                         cluster(rank(0), rank(1))))  # fmt: skip
    assert (t.state, t.values) == ("recovering", {})
    assert [e[0] for e in t.events] == [EV_STACKS]


def test_a_failed_action_fails_the_incident_with_its_error():
    t = only(transitions([incident(state="acting")], [],
                         [Outcome(1, "kill_rank", False, "hung", error="refused")], [], cluster()))  # fmt: skip
    assert t.state == "failed" and "refused" in t.values["verdict"]


def test_a_stop_is_final_and_keeps_its_verdict():
    inc = incident(kind="crash_loop", state="acting")
    t = only(transitions([inc], [], [Outcome(1, "stop_job", True, "crash loop: 3")], [], cluster()))
    assert (t.state, t.values["verdict"]) == ("stopped", "crash loop: 3")


def test_an_exclusion_of_a_crash_loop_is_not_followed_as_a_recovery():
    inc = incident(kind="crash_loop", state="acting")
    t = only(transitions([inc], [], [Outcome(1, "exclude_node", True, "x")], [], cluster()))
    assert t.state == "resolved"


# -- decisions to do nothing ----------------------------------------------------------


def test_nothing_to_do_recovers_what_torchrun_restarts_and_reports_the_rest():
    dead = incident(1, kind="rank_dead")
    slow = incident(2, kind="straggler")
    decisions = [
        Decision(finding("rank_dead", dead.key), "none", "torchrun restarts it"),
        Decision(finding("straggler", slow.key), "none", "report only: straggler"),
    ]
    found = [d.finding for d in decisions]
    moves = transitions([dead, slow], decisions, [], found, cluster(rank(0), rank(1)))
    assert [(t.incident_id, t.state) for t in moves] == [(1, "recovering"), (2, "reported")]
    assert moves[1].values == {"action": "none", "action_reason": "report only: straggler"}


def test_a_deferred_decision_leaves_the_incident_open_saying_why_it_waits():
    inc = incident()
    d = Decision(finding(key=inc.key), "none", "culprit unknown", deferred=True)
    t = only(transitions([inc], [d], [], [d.finding], cluster(rank(0), rank(1))))
    assert (t.state, t.values) == ("open", {"action_reason": "culprit unknown"})
    said = dataclasses.replace(inc, action_reason="culprit unknown")  # said once, not again
    assert transitions([said], [d], [], [d.finding], cluster(rank(0), rank(1))) == []


# -- recovery ---------------------------------------------------------------------------


def test_recovery_is_followed_to_the_first_new_step():
    inc = incident(state="recovering", action="kill_rank", restart_before=0)
    old = cluster(rank(0, state="exited"), rank(1, state="exited"))
    assert transitions([inc], [], [], [], old) == []
    new = cluster(rank(0, restart=1, step=None), rank(1, restart=1, step=None), time=T0 + 5)
    t = only(transitions([inc], [], [], [], new))
    assert (t.state, t.values) == ("recovering", {"restarted_at": T0 + 5})
    assert t.events == ((EV_RESTARTED, {"restart": 1}),)
    inc = dataclasses.replace(inc, restarted_at=T0 + 5)
    first = cluster(rank(0, restart=1, step=21, recent=[sample(21, 1)]), time=T0 + 7)
    t = only(transitions([inc], [], [], [], first))
    assert (t.state, t.values) == ("resolved", {"first_step_at": T0 + 7, "resumed_step": 20})
    assert t.events == ((EV_FIRST_STEP, {"step": 21}),)


def test_the_first_new_step_says_which_data_steps_the_resume_skipped():
    # a loss spike's rollback: the new incarnation's ranks report the skipped data steps
    inc = incident(kind="bad_numerics", state="recovering", action="kill_rank",
                   restart_before=0, restarted_at=T0 + 5)  # fmt: skip
    skips = ((41, 45), (50, 50))
    new = [dataclasses.replace(rank(r, restart=1, step=41, recent=[sample(41, 1)]),
                               resume_skips=skips) for r in (0, 1)]  # fmt: skip
    stale = dataclasses.replace(rank(0, restart=0, state="exited"), resume_skips=((1, 9),))
    t = only(transitions([inc], [], [], [], cluster(*new, time=T0 + 7)))
    assert t.events[0] == (EV_FIRST_STEP, {"step": 41})
    assert t.events[1] == (EV_DATA_SKIPPED, {
        "data_steps": [[41, 45], [50, 50]], "count": 6, "resumed_step": 40,
        "text": "skipped data steps 41..45, 50 (6 steps) after the rollback to the checkpoint"
                " of step 40"})  # fmt: skip
    # ranges are merged, never expanded; a restart that skipped nothing says nothing
    huge = [dataclasses.replace(new[0], resume_skips=((1, 2**62),)), stale]
    (_, (what, detail)) = only(transitions([inc], [], [], [], cluster(*huge))).events
    assert what == EV_DATA_SKIPPED and detail["count"] == 2**62
    plain = cluster(rank(0, restart=1, step=41, recent=[sample(41, 1)]))
    assert only(transitions([inc], [], [], [], plain)).events == ((EV_FIRST_STEP, {"step": 41}),)


def test_a_kill_and_its_whole_recovery_in_one_pass_apply_in_order():
    inc = incident(state="acting", action="kill_rank")
    obs = cluster(rank(0, restart=1, step=21, recent=[sample(21, 1)]))
    moves = transitions([inc], [], [Outcome(1, "kill_rank", True, "hung")], [], obs)
    assert [t.state for t in moves] == ["recovering", "resolved"]


def test_ranks_without_telemetry_recover_when_the_new_incarnation_runs():
    inc = incident(state="recovering", restart_before=0)
    obs = cluster(rank(0, restart=1, source="process"), rank(1, restart=1, source="process"))
    assert only(transitions([inc], [], [], [], obs)).state == "resolved"


def test_a_reported_fault_no_longer_seen_is_resolved():
    inc = incident(kind="straggler", state="reported")
    assert transitions([inc], [], [], [finding("straggler", inc.key)], cluster()) == []
    assert only(transitions([inc], [], [], [], cluster())).state == "resolved"
    # held by its detector (the rank is still slower, under the threshold): stays reported
    assert transitions([inc], [], [], [], cluster(), held={inc.key}) == []


# -- attribution: our own action's consequences -------------------------------------------


def test_the_death_of_a_rank_we_killed_is_a_step_of_the_hang():
    hang = incident(state="recovering", action="kill_rank", restart_before=3)
    death = finding("rank_dead", restart=3)
    keep, steps = attribute([death], [hang])
    assert keep == [] and steps == [(hang, death)]
    # the death of the next incarnation is a new fault
    later = finding("rank_dead", restart=4)
    assert attribute([later], [hang]) == ([later], [])
    # once the group restarted, the action's consequences are over
    done = dataclasses.replace(hang, restarted_at=T0 + 3)
    assert attribute([death], [done]) == ([death], [])
    # a death beside an incident we did nothing about is its own fault
    reported = incident(kind="bad_numerics", state="reported", action="none", restart_before=3)
    assert attribute([death], [reported]) == ([death], [])


def test_one_hang_of_an_incarnation_is_one_incident():
    hang = incident(key="rank_hung:j:0:29", state="acting", action="kill_rank", restart_before=0)
    again = finding("rank_hung", key="rank_hung:j:0:30", restart=0)
    (kept,), steps = attribute([again], [hang])
    assert kept.key == hang.key and steps == []
    next_incarnation = finding("rank_hung", key="rank_hung:j:1:40", restart=1)
    assert attribute([next_incarnation], [hang]) == ([next_incarnation], [])
    closed = dataclasses.replace(hang, state="resolved")
    assert attribute([again], [closed]) == ([again], [])


# -- the job ------------------------------------------------------------------------------


def test_goodput_counts_each_step_once():
    p = JobProgress("j", first_seen=T0)
    obs = cluster(rank(0, recent=[sample(s, seconds=0.5) for s in range(1, 5)]), time=T0 + 4)
    p = advance_progress(p, obs)
    assert (p.max_step, p.useful_seconds, p.goodput(T0 + 4)) == (4, 2.0, 0.5)
    replayed = cluster(rank(0, restart=1, recent=[sample(s, 1, 0.5) for s in range(3, 7)]))
    p = advance_progress(p, replayed)
    assert (p.max_step, p.useful_seconds) == (6, 3.0)  # steps 3 and 4 again: not counted


def test_job_state_from_incidents_and_ranks():
    p = JobProgress("j", first_seen=T0)
    running = cluster(rank(0), rank(1))
    assert job_state(p, [], running) == ("running", None)
    assert job_state(p, [incident(state="recovering")], running) == ("recovering", None)
    assert job_state(p, [incident(kind="straggler", state="reported")], running)[0] == "running"
    assert job_state(p, [incident(kind="rank_hung", job="other")], running)[0] == "running"
    done = cluster(rank(0, state="finished"), rank(1, state="finished"))
    assert job_state(p, [], done) == ("finished", None)
    stop = incident(kind="crash_loop", state="stopped", verdict="crash loop: 3 restarts")
    assert job_state(p, [stop], done) == ("stopped", "crash loop: 3 restarts")
    # a stop recorded earlier (the incident list holds no stopped one) stays a stop
    was = dataclasses.replace(p, state="stopped", verdict="budget")
    assert job_state(was, [], running) == ("stopped", "budget")


# -- the cluster verdict --------------------------------------------------------------------


def test_verdict_without_an_observation_is_unhealthy():
    v = cluster_verdict(None, {}, [], T0)
    assert v["status"] == "unhealthy" and v["reasons"][0]["code"] == "no_observation"


def test_verdict_healthy_degraded_unhealthy():
    jobs = {"j": JobProgress("j", first_seen=T0 - 10, max_step=30, useful_seconds=5.0)}
    v = cluster_verdict(cluster(rank(0), rank(1)), jobs, [], T0)
    assert (v["status"], v["reasons"]) == ("healthy", [])
    assert v["jobs"]["j"]["goodput"] == 0.5 and v["jobs"]["j"]["ranks"] == 2
    recovering = {"j": dataclasses.replace(jobs["j"], state="recovering")}
    v = cluster_verdict(cluster(rank(0)), recovering, [], T0)
    assert v["status"] == "degraded" and v["reasons"][0]["code"] == "job_recovering"
    slow = incident(kind="straggler", state="reported")
    assert cluster_verdict(cluster(rank(0)), jobs, [slow], T0)["status"] == "degraded"
    lost = cluster(reachable=False)
    assert cluster_verdict(lost, jobs, [], T0)["reasons"][0]["code"] == "agent_unreachable"
    stopped = {"j": dataclasses.replace(jobs["j"], state="stopped", verdict="crash loop")}
    v = cluster_verdict(cluster(rank(0)), stopped, [], T0)
    assert v["status"] == "unhealthy" and "crash loop" in v["reasons"][0]["message"]


def test_verdict_follows_the_node_verdict():
    bad = [{"severity": "unhealthy", "code": "xid", "message": "GPU 0: Xid 79"}]
    v = cluster_verdict(cluster(rank(0), status="unhealthy", reasons=bad), {}, [], T0)
    assert v["status"] == "unhealthy" and v["reasons"][0]["code"] == "node_xid"
    warn = [{"severity": "degraded", "code": "disk", "message": "90% full"}]
    v = cluster_verdict(cluster(rank(0), status="degraded", reasons=warn), {}, [], T0)
    assert v["status"] == "degraded"


# -- the intent log: what a restarted supervisor does with an unfinished action -------------


def test_a_pending_kill_is_carried_out_only_while_its_process_is_the_same():
    from rankguard.supervisor.reconcile import _still_waiting
    from rankguard.supervisor.store import Action

    inc = incident(state="acting", action="kill_rank", restart_before=0)
    target = {"job": "j", "rank": 1, "pid": rank(1).pid, "restart": 0}
    kill = Action(1, 1, "kill_rank", target, T0, None, None, None, None)
    assert _still_waiting(kill, inc, cluster(rank(0), rank(1))) is True  # not done: do it
    assert _still_waiting(kill, inc, cluster(rank(0), rank(1, state="exited"))) is False
    restarted = cluster(rank(0, restart=1), rank(1, restart=1))
    assert _still_waiting(kill, inc, restarted) is False  # done before the crash: not again
    assert _still_waiting(kill, inc, cluster(rank(0))) is None  # out of view: wait
    stop = Action(2, 1, "stop_job", {"job": "j"}, T0, None, None, None, None)
    assert _still_waiting(stop, inc, cluster(rank(0), rank(1))) is True
    assert _still_waiting(stop, inc, cluster(rank(0, state="exited"))) is False


def test_a_rank_seen_only_in_a_stale_answer_is_not_killed():
    from rankguard.supervisor.reconcile import STALE_ANSWER_SECONDS, _seen_only_stale

    fresh = cluster(rank(1), time=T0)
    assert not _seen_only_stale({"node": "n0", "rank": 1}, fresh)
    late = dataclasses.replace(fresh, time=T0 + STALE_ANSWER_SECONDS + 0.5)
    assert _seen_only_stale({"node": "n0", "rank": 1}, late)  # its agent stopped answering
    assert _seen_only_stale({"node": "n0"}, cluster(rank(1), reachable=False))
    # an answer behind the other agents' (they answered since; this one did not)
    other = dataclasses.replace(fresh.nodes[0], node="n1", observed_at=T0 + 1.0)
    behind = dataclasses.replace(fresh, time=T0 + 1.0, nodes=(fresh.nodes[0], other))
    assert _seen_only_stale({"node": "n0", "rank": 1}, behind)
    level = dataclasses.replace(
        behind, nodes=(fresh.nodes[0], dataclasses.replace(other, observed_at=T0 + 0.2))
    )
    assert not _seen_only_stale({"node": "n0", "rank": 1}, level)  # one pass apart: fine
