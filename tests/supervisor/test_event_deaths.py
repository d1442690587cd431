"""A death announced on /v1/rank-events, applied to the supervisor's last view of its
node (supervisor/events.py), and the dead detector's finding from that view."""

from __future__ import annotations

from builders import T0, cluster, nodeobs, rank

from rankguard.contract.answers import RankEventAnswer
from rankguard.supervisor.detectors import DetectorConfig, dead
from rankguard.supervisor.events import apply_deaths
from rankguard.supervisor.model import History


def event(r, *, pid, restart=0, state="exited", at=T0 + 1.0, seq=1, step=None, ckpt=None):
    return RankEventAnswer(seq, "j", r, pid, restart, "alive", state, at, None, step, ckpt)


def test_a_death_of_the_process_in_view_is_applied():
    node = nodeobs(rank(0), rank(1))
    out = apply_deaths(node, [event(1, pid=1001)])
    assert [(r.rank, r.state, r.exited_at) for r in out.ranks] == [
        (0, "alive", None),
        (1, "exited", T0 + 1.0),
    ]
    findings = dead.detect(cluster(nodes=(out,)), History(), DetectorConfig())
    assert [(f.kind, f.rank, f.key, f.occurred_at) for f in findings] == [
        ("rank_dead", 1, "rank_dead:j:0", T0 + 1.0)
    ]


def test_a_newer_incarnation_that_died_between_polls_is_applied():
    """The node was last seen at incarnation 0; incarnation 1 started and died since."""
    node = nodeobs(rank(0), rank(1))
    out = apply_deaths(node, [event(0, pid=7777, restart=1)])
    r0 = out.ranks[0]
    assert (r0.pid, r0.restart, r0.state) == (7777, 1, "exited")
    findings = dead.detect(cluster(nodes=(out,)), History(), DetectorConfig())
    assert [f.key for f in findings] == ["rank_dead:j:1"]


def test_old_news_and_other_states_leave_the_node_as_it_is():
    node = nodeobs(rank(0, restart=2), rank(1, state="exited", exited_at=T0))
    assert apply_deaths(node, [event(0, pid=5, restart=1)]) is node  # an older incarnation
    assert apply_deaths(node, [event(1, pid=1001)]) is node  # seen dead already
    assert apply_deaths(node, [event(0, pid=1200, state="stopped")]) is node  # not a death
    assert apply_deaths(node, [event(9, pid=1, restart=5)]) is node  # a rank not in view


def test_the_last_step_the_event_carries_replaces_a_stale_one():
    """The view is a poll old (step 53) and the rank died after step 56: the incident's
    steps lost are counted from 56 (the full suite's SIGKILL test saw 3 lost, not 6)."""
    node = nodeobs(rank(0, step=53), rank(1, step=53))
    out = apply_deaths(node, [event(1, pid=1001, step=56)])
    assert [r.step for r in out.ranks] == [53, 56]
    older = apply_deaths(node, [event(1, pid=1001, step=50)])  # never goes back
    assert [r.step for r in older.ranks] == [53, 53]


def test_the_checkpoint_the_event_carries_replaces_the_views():
    """Incarnation 1 resumed from step 20 and died within one poll of the node, last seen
    at incarnation 0 before its checkpoint of step 20 was validated: the death is recorded
    with step 20, so the crash-loop guard does not count the restart as progress."""
    node = nodeobs(rank(0), rank(1))
    out = apply_deaths(node, [event(1, pid=7777, restart=1, ckpt=20)])
    assert [r.checkpoint_step for r in out.ranks] == [None, 20]
    unknown = apply_deaths(nodeobs(rank(0), rank(1, ckpt=10)), [event(1, pid=7777, restart=1)])
    assert [r.checkpoint_step for r in unknown.ranks] == [None, 10]  # an older agent: kept


def test_an_event_death_and_the_replaced_incarnation_path_give_one_key():
    """The event names incarnation 1's death at once; the next poll shows incarnation 2
    running and 1's ranks dead (History.restarts_before, detectors/dead.py): the same
    finding key, so the store keeps one incident for the one death."""
    node = nodeobs(rank(0, restart=1), rank(1, restart=1))  # pids 1100, 1101
    by_event = apply_deaths(node, [event(1, pid=1101, restart=1)])
    first = dead.detect(cluster(nodes=(by_event,)), History(), DetectorConfig())
    polled = nodeobs(
        rank(0, restart=1, state="exited", exited_at=T0 + 1.5),
        rank(1, restart=1, state="exited", exited_at=T0 + 1.0),
        rank(0, restart=2),
        rank(1, restart=2),
    )
    history = History(restarts_before={"j": 1}, restarts={"j": 2})
    second = dead.detect(cluster(nodes=(polled,)), history, DetectorConfig())
    assert [(f.key, f.rank) for f in first] == [("rank_dead:j:1", 1)]
    assert [(f.key, f.rank) for f in second] == [("rank_dead:j:1", 1)]


def test_a_hang_named_by_its_stacks_keeps_them_when_its_finding_comes_again(tmp_path):
    """An event pass re-emits the window detectors' carried finding (no rank, no stacks)
    after the kill; the incident keeps the stacks that named the rank (the full suite's
    hang test lost them once the event path was in)."""
    from rankguard.supervisor.model import RANK_HUNG, Finding
    from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
    from rankguard.supervisor.store import IncidentStore

    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [], "t" * 16, SupervisorConfig())
    try:
        raw = Finding(RANK_HUNG, "rank_hung:j:0", "critical", "hung", "j", None, None, T0,
                      {"stacks_needed": True})  # fmt: skip
        named = Finding(RANK_HUNG, raw.key, "critical", "hung", "j", "n0", 1, T0,
                        {"stacks_needed": True, "stacks": {"1": "Thread 7 (active)"},
                         "culprit_reason": "odd one out"})  # fmt: skip
        store.upsert_finding(named, T0)
        again = sup._refine(raw, cluster(rank(0), rank(1)))
        assert (again.rank, again.node) == (1, "n0")
        assert again.evidence["stacks"] == {"1": "Thread 7 (active)"}
        assert again.evidence["culprit_reason"] == "odd one out"
    finally:
        sup.close()
        store.close()


def test_a_death_waiting_puts_the_window_detectors_off_a_pass(tmp_path):
    """A full pass with an announced death waiting runs only the per-pass detectors (the
    death's event pass comes right after it), and the window detectors are due next pass."""
    from rankguard.supervisor.reconcile import EVERY_PASS, Supervisor, SupervisorConfig
    from rankguard.supervisor.store import IncidentStore

    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [], "t" * 16, SupervisorConfig())
    try:
        obs = cluster(rank(0), rank(1))
        with sup.events._lock:
            sup.events._deaths.append(("http://n0:9400", event(1, pid=1001)))
        sup._detect(obs)
        assert sup._window_findings == {} and sup._window_restarts is None
        sup.events.take()
        sup._detect(obs)
        assert set(sup._window_findings) and not set(sup._window_findings) & EVERY_PASS
        assert sup._window_restarts == {"j": 0}
    finally:
        sup.close()
        store.close()


def test_a_full_pass_judges_a_death_announced_while_it_polled(tmp_path):
    """The poll round's view still shows the rank alive; the death announced meanwhile is
    applied to that view and recorded by this pass, not the next (docs/scaling.md)."""
    import time

    from rankguard.supervisor.reconcile import Supervisor, SupervisorConfig
    from rankguard.supervisor.store import IncidentStore

    store = IncidentStore(tmp_path / "db.sqlite")
    sup = Supervisor(store, lambda: [], "t" * 16, SupervisorConfig())
    try:
        obs = cluster(rank(0), rank(1))
        (node,) = obs.nodes
        sup.poller._last[node.url] = node  # the answer this view was built from
        with sup.events._lock:
            sup.events._deaths.append((node.url, event(1, pid=1001)))
        sup._pass(obs, time.perf_counter())
        (incident,) = store.open_incidents()
        assert (incident.kind, incident.rank) == ("rank_dead", 1)
        assert (sup.passes, sup.event_passes) == (1, 1)
        assert [r.state for r in sup.last_obs.ranks()] == ["alive", "exited"]
    finally:
        sup.close()
        store.close()
