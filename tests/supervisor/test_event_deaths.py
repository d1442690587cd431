"""A death announced on /v1/rank-events, applied to the supervisor's last view of its
node (supervisor/events.py), and the dead detector's finding from that view."""

from __future__ import annotations

from builders import T0, cluster, nodeobs, rank

from rankguard.contract.answers import RankEventAnswer
from rankguard.supervisor.detectors import DetectorConfig, dead
from rankguard.supervisor.events import apply_deaths
from rankguard.supervisor.model import History


def event(r, *, pid, restart=0, state="exited", at=T0 + 1.0, seq=1, step=None):
    return RankEventAnswer(seq, "j", r, pid, restart, "alive", state, at, None, step)


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
