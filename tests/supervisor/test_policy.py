"""The pure policy (supervisor/policy.py): literal findings and views, no clock, no I/O.
The last tests drive it through a real incident store, as the loop does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankguard.supervisor.model import (
    ACT_EXCLUDE_NODE,
    ACT_KILL_RANK,
    ACT_NONE,
    ACT_STOP_JOB,
    AGENT_UNREACHABLE,
    BAD_NUMERICS,
    CHECKPOINT_STALE,
    CRASH_LOOP,
    NODE_FAULT,
    RANK_DEAD,
    RANK_HUNG,
    STRAGGLER,
    Finding,
)
from rankguard.supervisor.policy import (
    CULPRIT_UNKNOWN,
    SPIKE_IN_CHECKPOINT,
    IncidentInfo,
    JobView,
    PolicyConfig,
    PolicyView,
    RestartRecord,
    decide,
)
from rankguard.supervisor.reconcile import build_policy_view as build_view
from rankguard.supervisor.store import IncidentStore

CFG = PolicyConfig()
EMPTY = PolicyView()


def finding(kind: str, key: str | None = None, job: str | None = "j", node="n1", rank=None,
            severity="critical", occurred_at=100.0, **evidence) -> Finding:  # fmt: skip
    return Finding(kind, key or f"{kind}:{job}:{rank}", severity, f"{kind} on {node}", job,
                   node, rank, occurred_at, evidence)  # fmt: skip


def one(findings, view=EMPTY, cfg=CFG, now=1000.0):
    out = decide(list(findings) if isinstance(findings, list) else [findings], view, cfg, now)
    assert len(out) == 1, out
    return out[0]


def jobs(**job_views: JobView) -> PolicyView:
    return PolicyView(jobs=job_views)


# --------------------------------------------------------------------------- rules


def test_dead_rank_is_left_to_torchrun():
    d = one(finding(RANK_DEAD, rank=1, restart=0))
    assert (d.action, d.reason) == (ACT_NONE, "torchrun restarts the worker group by itself")


def test_hung_rank_with_culprit_is_killed():
    f = finding(RANK_HUNG, culprit={"rank": 3, "node": "n2", "pid": 4242, "node_url": "http://n2"})
    d = one(f)
    assert d.action == ACT_KILL_RANK
    assert d.target == {"job": "j", "rank": 3, "node": "n2", "pid": 4242, "node_url": "http://n2"}
    # The culprit named by the finding's own rank/node.
    assert one(finding(RANK_HUNG, rank=2)).target == {"job": "j", "rank": 2, "node": "n1"}


def test_hung_without_culprit_asks_for_stacks():
    d = one(finding(RANK_HUNG, culprit=None))
    assert (d.action, d.reason) == (ACT_NONE, CULPRIT_UNKNOWN)
    assert one(finding(RANK_HUNG)).reason == CULPRIT_UNKNOWN
    # The loop captured stacks and found the culprit: decided again, same key, now a kill.
    refined = one(finding(RANK_HUNG, culprit=5))
    assert (refined.action, refined.target["rank"]) == (ACT_KILL_RANK, 5)
    assert "node" not in refined.target  # rank 5's node is not the finding's: loop resolves


def test_hung_behind_an_unreachable_agent_kills_a_reachable_rank():
    via = {"rank": 0, "node": "n0", "pid": 1000, "node_url": "http://n0"}
    d = one(finding(RANK_HUNG, restart_via=via, culprit_reason="1 of 3 ranks out of view"))
    assert d.action == ACT_KILL_RANK and "out of view" in d.reason
    assert d.target == {"job": "j", **via}


@pytest.mark.parametrize("evidence", [{"nonfinite": True}, {"loss": float("nan")},
                                      {"loss": "Infinity"}, {"reason": "non_finite"}])  # fmt: skip
def test_nonfinite_loss_restarts_from_checkpoint(evidence):
    d = one(finding(BAD_NUMERICS, anomaly_step=50, checkpoint_step=60, **evidence))
    assert d.action == ACT_KILL_RANK and d.target == {"job": "j", "rank": 0}


def test_loss_spike_after_the_newest_checkpoint_restarts():
    d = one(finding(BAD_NUMERICS, rank=1, reason="spike", loss=9.5, anomaly_step=55,
                    checkpoint_step=50))  # fmt: skip
    assert d.action == ACT_KILL_RANK and d.target == {"job": "j", "rank": 1, "node": "n1"}
    # The checkpoint step may come from the observation instead of the evidence.
    view = jobs(j=JobView(checkpoint_step=50))
    assert one(finding(BAD_NUMERICS, loss=9.5, anomaly_step=55), view).action == ACT_KILL_RANK


@pytest.mark.parametrize("anomaly,ckpt", [(50, 50), (40, 50), (None, 50), (55, None)])
def test_loss_spike_maybe_in_the_checkpoint_is_only_reported(anomaly, ckpt):
    d = one(finding(BAD_NUMERICS, loss=9.5, anomaly_step=anomaly, checkpoint_step=ckpt))
    assert (d.action, d.reason) == (ACT_NONE, SPIKE_IN_CHECKPOINT)


def test_straggler_reported_or_excluded():
    f = finding(STRAGGLER, rank=2)
    assert one(f).action == ACT_NONE
    d = one(f, cfg=PolicyConfig(exclude_stragglers=True))
    assert d.action == ACT_EXCLUDE_NODE and d.target == {"node": "n1", "job": "j"}


@pytest.mark.parametrize(
    "severity,evidence,action",
    [
        ("critical", {"hardware": True, "code": "xid_79", "url": "http://n1"}, ACT_EXCLUDE_NODE),
        ("warning", {"hardware": True}, ACT_NONE),
        ("critical", {"hardware": False, "disk": "full"}, ACT_NONE),
        ("critical", {}, ACT_NONE),
    ],
)
def test_node_fault(severity, evidence, action):
    d = one(finding(NODE_FAULT, job=None, severity=severity, **evidence))
    assert d.action == action
    if action == ACT_EXCLUDE_NODE:
        assert d.target == {"node": "n1", "node_url": "http://n1"}


def xid79(node: str) -> Finding:
    return finding(NODE_FAULT, f"node_fault:{node}:xid_79", job=None, node=node, hardware=True,
                   code="xid_79", url=f"http://{node}")  # fmt: skip


def test_the_fleet_brake_caps_exclusions_by_number_and_share():
    """XID 79 on 5 of 8 nodes with a cap of 2: two are excluded, the rest recorded only;
    a node already excluded within the window counts, and costs nothing again."""
    cfg = PolicyConfig(max_exclusions=2, max_exclusion_share=1.0)
    view = PolicyView(nodes=8)
    out = decide([xid79(f"n{i}") for i in range(5)], view, cfg, 1000.0)
    assert [d.action for d in out] == [ACT_EXCLUDE_NODE] * 2 + [ACT_NONE] * 3
    assert all("fleet brake: 2 nodes excluded within 3600s (at most 2)" in d.reason
               for d in out[2:])  # fmt: skip
    # a pass later, with the two on record: still braked; a second fault of an excluded
    # node goes through, and so does a node once the window has let the old ones go
    done = PolicyView(nodes=8, exclusions=((990.0, "n0"), (990.0, "n1")))
    assert one(xid79("n2"), done, cfg).action == ACT_NONE
    again = finding(NODE_FAULT, "node_fault:n1:gpu_lost", job=None, node="n1", hardware=True)
    assert one(again, done, cfg).action == ACT_EXCLUDE_NODE
    assert one(xid79("n2"), done, cfg, now=990.0 + 3601).action == ACT_EXCLUDE_NODE
    # the share: a quarter of 8 nodes is 2, of 2 nodes still one
    assert [d.action for d in decide([xid79("a"), xid79("b")], PolicyView(nodes=2), CFG, 0.0)] == [
        ACT_EXCLUDE_NODE, ACT_NONE]  # fmt: skip


def test_a_dry_run_action_is_recorded_as_what_would_have_been_done():
    cfg = PolicyConfig(dry_run="exclude_node, kill_rank")
    d = one(xid79("n3"), cfg=cfg)
    assert d.action == ACT_NONE and d.reason.startswith("dry run: would exclude_node: ")
    assert d.target["node"] == "n3"
    with pytest.raises(ValueError, match="dry_run: unknown action drain"):
        PolicyConfig(dry_run="drain")


@pytest.mark.parametrize("kind", [AGENT_UNREACHABLE, CHECKPOINT_STALE])
def test_monitoring_faults_never_kill(kind):
    d = one(finding(kind, rank=0, culprit=0, hardware=True, nonfinite=True))
    assert d.action == ACT_NONE and "monitoring" in d.reason


# --------------------------------------------------------------------------- idempotency


def test_decided_twice_acts_once():
    f = finding(RANK_HUNG, rank=3)
    assert one(f).action == ACT_KILL_RANK
    acted = PolicyView(incidents={f.key: IncidentInfo(id=1, actions=(ACT_KILL_RANK,))})
    assert decide([f], acted, CFG, 1001.0) == []
    # An incident that exists but was not acted on (e.g. deferred) is decided again.
    waiting = PolicyView(incidents={f.key: IncidentInfo(id=1)})
    assert one(f, waiting).action == ACT_KILL_RANK


# --------------------------------------------------------------------------- budget, backoff


def test_backoff_doubles_and_is_capped():
    f = finding(RANK_HUNG, rank=3)
    after_one = jobs(j=JobView(restart_actions=(1000.0,)))
    assert one(f, after_one, now=1000.5).reason == "backoff until 1001.000"
    assert one(f, after_one, now=1001.0).action == ACT_KILL_RANK
    after_three = jobs(j=JobView(restart_actions=(900.0, 950.0, 1000.0)))
    assert one(f, after_three, now=1003.9).action == ACT_NONE  # 1 * 2**2 = 4s
    assert one(f, after_three, now=1004.0).action == ACT_KILL_RANK
    cfg = PolicyConfig(max_restarts=50, backoff_max_seconds=60.0)
    after_nine = jobs(j=JobView(restart_actions=tuple(1000.0 - i for i in range(9))))
    assert one(f, after_nine, cfg, now=1059.0).reason == "backoff until 1060.000"  # not 256s
    assert one(f, after_nine, cfg, now=1060.0).action == ACT_KILL_RANK


def test_budget_exhausted_stops_the_job():
    f = finding(RANK_HUNG, rank=3)
    ten = jobs(j=JobView(restart_actions=tuple(float(t) for t in range(100, 1000, 90))))
    d = one(f, ten, now=2000.0)
    assert d.action == ACT_STOP_JOB and d.target == {"job": "j"}
    assert d.reason.startswith("restart budget exhausted: 10 restarts within 3600s")
    d = one(f, ten, PolicyConfig(stop_on_budget_exhausted=False), now=2000.0)
    assert d.action == ACT_NONE and d.reason.startswith("restart budget exhausted")
    # Out of the window, they no longer count.
    assert one(f, ten, now=100.0 + 3600.0 + 1000.0).action == ACT_KILL_RANK


def test_one_restart_per_job_per_pass():
    hang_ = finding(RANK_HUNG, rank=3)
    nan = finding(BAD_NUMERICS, nonfinite=True)
    other_job = finding(RANK_HUNG, job="k", rank=1)
    out = decide([hang_, nan, other_job], EMPTY, PolicyConfig(backoff_base_seconds=0.0), 1000.0)
    assert [d.action for d in out] == [ACT_KILL_RANK, ACT_NONE, ACT_KILL_RANK]


def test_a_stopped_job_is_not_restarted():
    view = jobs(j=JobView(stopped_at=500.0, restart_actions=(400.0,) * 10))
    assert one(finding(RANK_HUNG, rank=3, occurred_at=450.0), view).action == ACT_NONE
    # A new run of the job after the stop starts with a fresh budget.
    assert one(finding(RANK_HUNG, rank=3, occurred_at=900.0), view).action == ACT_KILL_RANK


# --------------------------------------------------------------------------- crash loop


def restarts(*ckpts, start=0) -> tuple[RestartRecord, ...]:
    return tuple(
        RestartRecord(key=f"dead:j:{i}", at=100.0 * (i + 1), restart=i, checkpoint_step=c)
        for i, c in enumerate(ckpts, start)
    )


def test_crash_loop_stops_on_third_restart_without_progress():
    view = jobs(j=JobView(restarts=restarts(10, 10), checkpoint_step=10))
    third = finding(RANK_DEAD, key="dead:j:2", restart=2)
    dead_d, loop = decide([third], view, CFG, 1000.0)
    assert dead_d.action == ACT_NONE and "crash loop" in dead_d.reason
    assert loop.finding.kind == CRASH_LOOP and loop.finding.key == "crash_loop:j:10"
    assert (loop.action, loop.target) == (ACT_STOP_JOB, {"job": "j"})
    assert loop.reason == "crash loop: 3 restarts without checkpoint progress past step 10"
    assert loop.finding.evidence["restarts"] == ["dead:j:0", "dead:j:1", "dead:j:2"]
    # Second restart only: no guard yet.
    assert len(decide([third], jobs(j=JobView(restarts=restarts(10))), CFG, 1000.0)) == 1


def test_crash_loop_not_tripped_when_checkpoints_advance():
    view = jobs(j=JobView(restarts=restarts(10, 20, 30, 40), checkpoint_step=50))
    out = decide([finding(RANK_DEAD, key="dead:j:9", restart=9)], view, CFG, 1000.0)
    assert len(out) == 1
    # Progress before the last three restarts does not excuse them.
    stuck = jobs(j=JobView(restarts=restarts(10, 20, 50, 50), checkpoint_step=50))
    assert len(decide([finding(RANK_DEAD, key="x", restart=9)], stuck, CFG, 1000.0)) == 2


def test_crash_loop_stops_instead_of_the_third_kill():
    view = jobs(j=JobView(restarts=restarts(None, None), checkpoint_step=None))
    hung, loop = decide([finding(RANK_HUNG, rank=3, restart=2)], view, CFG, 300.0)
    assert hung.action == ACT_NONE and loop.action == ACT_STOP_JOB
    assert loop.finding.key == "crash_loop:j:none"
    assert loop.reason.endswith(
        "(no validated checkpoint), the incarnations between them each under 600 s"
    )


def test_crash_loop_verdict_names_the_checkpoint_known_before_unreported_restarts():
    """Ranks that die before reporting a checkpoint (their resume failed) leave restarts
    without a step; the verdict names the validated step the job had, not none."""
    view = jobs(j=JobView(restarts=restarts(60, None), checkpoint_step=None))
    _, loop = decide([finding(RANK_DEAD, key="dead:j:2", restart=2)], view, CFG, 1000.0)
    assert loop.finding.key == "crash_loop:j:60"
    assert loop.reason == "crash loop: 3 restarts without checkpoint progress past step 60"
    assert loop.finding.evidence["checkpoint_step"] == 60
    # A lower step reported later (the newest one quarantined at resume) is what is there.
    lower = jobs(j=JobView(restarts=restarts(60, 40), checkpoint_step=40))
    _, loop = decide([finding(RANK_DEAD, key="dead:j:2", restart=2)], lower, CFG, 1000.0)
    assert loop.reason.endswith("past step 40")
    # An unreported restart after progress does not hide the progress either.
    advanced = jobs(j=JobView(restarts=restarts(10, 10, 60), checkpoint_step=None))
    assert len(decide([finding(RANK_DEAD, key="dead:j:9", restart=9)], advanced, CFG, 1e3)) == 1


def test_a_job_without_checkpoints_loops_only_through_short_lived_incarnations():
    """A script that reports no checkpoint (zero-code): the life of each incarnation
    between two restarts is the measure of progress, `crash_loop_progress_seconds`."""
    cfg = PolicyConfig(crash_loop_progress_seconds=250.0)  # restarts() are 100 s apart
    view = jobs(j=JobView(restarts=restarts(None, None)))
    third = finding(RANK_DEAD, key="dead:j:2", restart=2)
    assert len(decide([third], view, cfg, 300.0)) == 2  # 100 s each: a loop
    # the incarnation before this death trained 700 s: progress, not a loop
    assert len(decide([third], view, cfg, 900.0)) == 1
    # a long life earlier ends the run before it: 2 quick restarts after it, not 3
    spread = jobs(j=JobView(restarts=(*restarts(None), *restarts(None, start=5))))
    assert [r.at for r in spread.jobs["j"].restarts] == [100.0, 600.0]
    assert len(decide([finding(RANK_DEAD, key="d", restart=6)], spread, cfg, 700.0)) == 1
    # a checkpoint known on either side is the measure, however long the life
    known = jobs(j=JobView(restarts=restarts(10, 10), checkpoint_step=10))
    assert len(decide([third], known, cfg, 5000.0)) == 2


def test_incidents_of_one_incarnation_are_one_restart():
    # The hang we killed in incarnation 0 and the dead record of the killed rank.
    recs = (RestartRecord("hang:j:0", 100.0, 0, 10), RestartRecord("dead:j:0:3", 101.0, 0, 10))
    view = jobs(j=JobView(restarts=recs, checkpoint_step=10))
    assert len(decide([finding(RANK_DEAD, key="dead:j:1:3", restart=1)], view, CFG, 1000.0)) == 1


def test_crash_loop_is_decided_once():
    view = PolicyView(
        incidents={"crash_loop:j:10": IncidentInfo(7, (ACT_STOP_JOB,))},
        jobs={"j": JobView(restarts=restarts(10, 10), checkpoint_step=10)},
    )
    assert len(decide([finding(RANK_DEAD, key="dead:j:2", restart=2)], view, CFG, 1000.0)) == 1
    # A stop also wipes the slate: history from before it does not count.
    stopped = jobs(j=JobView(restarts=restarts(10, 10), checkpoint_step=10, stopped_at=250.0))
    assert len(decide([finding(RANK_DEAD, key="dead:j:2", restart=2)], stopped, CFG, 1e3)) == 1


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_restarts": 0},
        {"budget_window_seconds": 0},
        {"backoff_base_seconds": -1},
        {"backoff_base_seconds": 10, "backoff_max_seconds": 5},
        {"crash_loop_restarts": 0},
        {"crash_loop_progress_seconds": 0},
    ],
)
def test_config_is_validated(kwargs):
    with pytest.raises(ValueError):
        PolicyConfig(**kwargs)


# --------------------------------------------------------------------------- properties

evidence = st.dictionaries(
    st.sampled_from(["culprit", "hardware", "nonfinite", "loss", "anomaly_step",
                     "checkpoint_step", "restart"]),
    st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.floats(allow_nan=True)),
)  # fmt: skip
monitoring = st.builds(
    Finding,
    kind=st.sampled_from([AGENT_UNREACHABLE, CHECKPOINT_STALE]),
    key=st.text(min_size=1, max_size=8),
    severity=st.sampled_from(["info", "warning", "critical"]),
    summary=st.just("x"),
    job=st.sampled_from([None, "j", "k"]),
    node=st.sampled_from([None, "n1"]),
    rank=st.one_of(st.none(), st.integers(0, 7)),
    evidence=evidence,
)
job_view = st.builds(
    JobView,
    restarts=st.lists(
        st.builds(RestartRecord, key=st.text(max_size=4), at=st.floats(0, 2000),
                  restart=st.one_of(st.none(), st.integers(0, 3)),
                  checkpoint_step=st.one_of(st.none(), st.integers(0, 30))),
        max_size=6,
    ).map(tuple),
    restart_actions=st.lists(st.floats(0, 2000), max_size=12).map(tuple),
    stopped_at=st.one_of(st.none(), st.floats(0, 2000)),
    checkpoint_step=st.one_of(st.none(), st.integers(0, 30)),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(monitoring, max_size=6), st.dictionaries(st.sampled_from(["j", "k"]), job_view))
def test_monitoring_faults_never_kill_or_stop(findings, job_views):
    out = decide(findings, PolicyView(jobs=job_views), CFG, 1000.0)
    assert len(out) == len(findings)
    assert all(d.action == ACT_NONE for d in out)


# --------------------------------------------------------------------------- with the store


def test_loop_with_a_real_store(tmp_path):
    """observe -> upsert -> build_view -> decide -> begin_action, as the loop does, over
    three torchrun incarnations that never get past checkpoint 10."""
    store = IncidentStore(tmp_path / "incidents.db")
    try:
        now = 1000.0
        hang_ = finding(RANK_HUNG, key="hang:j:0", rank=3, restart=0)

        def reconcile(findings, ckpt=10):
            for f in findings:
                store.upsert_finding(f, now, checkpoint_step=ckpt)
            view = build_view(store, findings, CFG, now, checkpoint_steps={"j": ckpt})
            decisions = decide(findings, view, CFG, now)
            for d in decisions:
                inc, _ = store.upsert_finding(d.finding, now, checkpoint_step=ckpt)
                if d.action != ACT_NONE:
                    store.begin_action(inc.id, d.action, d.target, now)
            return decisions

        assert [d.action for d in reconcile([hang_])] == [ACT_KILL_RANK]
        assert reconcile([hang_]) == []  # next poll, the hang still shows: no second kill
        now += 30
        assert [d.action for d in reconcile([finding(RANK_DEAD, key="dead:j:1", restart=1)])] == [
            ACT_NONE
        ]
        now += 30
        out = reconcile([finding(RANK_DEAD, key="dead:j:2", restart=2)])
        assert [d.action for d in out] == [ACT_NONE, ACT_STOP_JOB]
        loop = store.by_key("crash_loop:j:10")
        assert loop is not None and store.has_action(loop.id, ACT_STOP_JOB)
        now += 30  # the same dead rank still reported: the stop is not decided again
        assert [d.action for d in reconcile([finding(RANK_DEAD, key="dead:j:2", restart=2)])] == [
            ACT_NONE
        ]
    finally:
        store.close()


def test_straggler_exclusion_is_a_config_file_setting_off_by_default(tmp_path):
    """[policy] exclude_stragglers in the supervisor's config file: off by default (a
    confirmed straggler is reported only); on, its node is excluded."""
    from rankguard.supervisor.config import load

    f = finding(STRAGGLER, rank=2)
    default = load(None).runtime().policy
    assert default.exclude_stragglers is False and one(f, cfg=default).action == ACT_NONE
    path = tmp_path / "supervisor.toml"
    path.write_text("[policy]\nexclude_stragglers = true\n")
    on = load(path).runtime().policy
    d = one(f, cfg=on)
    assert d.action == ACT_EXCLUDE_NODE and d.target == {"node": "n1", "job": "j"}


def test_the_same_known_cause_on_every_restart_stops_the_job_even_with_progress():
    """A GPU whose memory keeps failing kills the job every so often; the checkpoints
    advance between the deaths, so only the shared cause shows the loop."""
    xid = {"gpu": {"uuid": "GPU-1", "xid_recent": {"48": 1}}}
    records = tuple(RestartRecord(f"dead:j:{i}", 100.0 * (i + 1), i, 10 * (i + 1), "gpu_memory")
                    for i in range(4))  # fmt: skip
    view = jobs(j=JobView(restarts=records, checkpoint_step=40))
    fifth = finding(RANK_DEAD, key="dead:j:4", restart=4, **xid)
    dead_d, loop = decide([fifth], view, CFG, 1000.0)
    assert dead_d.action == ACT_NONE and loop.action == ACT_STOP_JOB
    assert loop.finding.key == "crash_loop:j:cause:dead:j:4"
    assert loop.reason.startswith("crash loop: 5 restarts in a row for one cause, gpu_memory "
                                  "(XID 48 on its GPU: double-bit ECC error)")  # fmt: skip
    assert loop.finding.evidence["cause"]["cause"] == "gpu_memory"
    # another cause in between, an unknown one, or the guard off: the job goes on
    mixed = records[:2] + (RestartRecord("dead:j:2", 300.0, 2, 30, "user_code"),) + records[3:]
    assert len(decide([fifth], jobs(j=JobView(restarts=mixed)), CFG, 1000.0)) == 1
    assert len(decide([finding(RANK_DEAD, key="dead:j:4", restart=4)], view, CFG, 1e3)) == 1
    off = PolicyConfig(same_cause_restarts=0)
    assert len(decide([fifth], view, off, 1000.0)) == 1


def test_a_guess_never_counts_toward_a_same_cause_loop(tmp_path):
    """Through the store: five deaths by SIGKILL (host, a low-confidence guess: the OOM
    killer or an operator) leave the job running; five with an XID 48 stop it."""
    from rankguard.contract.causes import HOST

    def deaths(store, n, **evidence):
        for i in range(n):
            store.upsert_finding(finding(RANK_DEAD, key=f"dead:j:{i}", restart=i,
                                         checkpoint_step=10 * (i + 1), **evidence),
                                 now=100.0 * (i + 1))  # fmt: skip

    with IncidentStore(tmp_path / "a.db") as store:
        deaths(store, 4, exit_code=9)
        assert store.list_incidents()[0].cause == HOST
        assert all(r.cause is None for r in store.restart_history("j"))
        sixth = finding(RANK_DEAD, key="dead:j:5", restart=5, exit_code=9)
        assert len(decide([sixth], build_view(store, [sixth], CFG, now=1e3), CFG, 1e3)) == 1
    with IncidentStore(tmp_path / "b.db") as store:
        xid = {"gpu": {"uuid": "GPU-1", "xid_recent": {"48": 1}}}
        deaths(store, 4, **xid)
        fifth = finding(RANK_DEAD, key="dead:j:5", restart=5, **xid)
        assert len(decide([fifth], build_view(store, [fifth], CFG, now=1e3), CFG, 1e3)) == 2


def failing(t: float, seen: float | None, jobs: dict | None = None) -> Finding:
    """A GPU predicted to fail on n1, observed at `t`; the job j's newest checkpoint was
    first seen at `seen`."""
    if jobs is None:
        jobs = {"j": {"checkpoint_step": 40, "checkpoint_seen_at": seen}}
    ev = {"code": "gpu_failing", "hardware": False, "failing": True, "jobs": jobs}
    return finding(NODE_FAULT, key="node_fault:n1:gpu_failing", job=None, severity="warning",
                   occurred_at=t, **ev)  # fmt: skip


def test_a_failing_gpu_is_drained_at_the_next_checkpoint_boundary_when_predictive_drain_is_on():
    on = PolicyConfig(predictive_drain=True, predictive_drain_wait_seconds=600)
    # off (the default): reported only
    d = one(failing(100.0, 90.0), cfg=CFG)
    assert (d.action, d.reason) == (
        ACT_NONE,
        "report only: a failing GPU (predictive drain is off)",
    )
    # first seen: wait for the job's next checkpoint (the one it has predates the prediction)
    d = one(failing(100.0, 90.0), cfg=on)
    assert d.deferred and d.reason == "predictive drain: waiting for the next checkpoint of j"
    seen_at_100 = PolicyView(incidents={"node_fault:n1:gpu_failing": IncidentInfo(1, (), 100.0)})
    assert one(failing(105.0, 90.0), seen_at_100, on).deferred
    # a checkpoint first seen after the prediction: the node goes now
    d = one(failing(130.0, 120.0), seen_at_100, on)
    assert d.action == ACT_EXCLUDE_NODE and d.target["node"] == "n1"
    assert d.reason == "predictive drain: a failing GPU, its jobs' next checkpoint was taken"
    # no checkpoint for the whole wait: at once; no job on the node: at once
    assert one(failing(700.0, 90.0), seen_at_100, on).reason.endswith("no checkpoint within 600s")
    d = one(failing(100.0, None, jobs={}), cfg=on)
    assert d.action == ACT_EXCLUDE_NODE and d.reason.endswith("no job on it")


def test_a_failing_gpu_asks_each_job_that_reports_steps_to_save_about_ten_seconds_ahead():
    on = PolicyConfig(predictive_drain=True)
    jobs = {
        "fast": {"checkpoint_seen_at": 90.0, "restart": 2, "step": 500, "step_seconds": 0.25},
        "slow": {"checkpoint_seen_at": 90.0, "restart": 0, "step": 7, "step_seconds": 30.0},
        "zero_code": {"checkpoint_seen_at": 90.0, "restart": 0, "step": None},
    }
    d = one(failing(100.0, 90.0, jobs=jobs), cfg=on)
    assert d.deferred and d.action == ACT_NONE
    # 10 s of 0.25 s steps is 40 ahead; a 30 s step still saves 3 steps ahead (the request
    # must reach every rank first); a job without steps keeps its own schedule
    assert d.target["save"] == {
        "fast": {"restart": 2, "step": 540},
        "slow": {"restart": 0, "step": 10},
    }
    # a dry-run drain asks nobody to save
    dry = PolicyConfig(predictive_drain=True, dry_run="exclude_node")
    assert "save" not in one(failing(100.0, 90.0, jobs=jobs), cfg=dry).target
    # once the checkpoint is taken, the node goes: no save asked any more
    seen = PolicyView(incidents={"node_fault:n1:gpu_failing": IncidentInfo(1, (), 95.0)})
    d = one(failing(130.0, 120.0, jobs={"fast": {**jobs["fast"], "checkpoint_seen_at": 120.0}}),
            seen, on)  # fmt: skip
    assert d.action == ACT_EXCLUDE_NODE and "save" not in d.target
