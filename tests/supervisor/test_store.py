"""The incident store (supervisor/store.py): a real SQLite file in a tmp dir."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
import threading

import pytest

from rankguard.supervisor.model import (
    ACT_KILL_RANK,
    ACT_STOP_JOB,
    RANK_DEAD,
    RANK_HUNG,
    Finding,
)
from rankguard.supervisor.policy import PolicyConfig
from rankguard.supervisor.reconcile import build_policy_view as build_view
from rankguard.supervisor.store import (
    SCHEMA_VERSION,
    ActionExists,
    IncidentStore,
    InvalidTransition,
    StoreError,
)


def hang(key: str = "hang:j:0:3", job: str = "j", **evidence) -> Finding:
    return Finding(
        kind=RANK_HUNG,
        key=key,
        severity="critical",
        summary="rank 3 hung in train",
        job=job,
        node="n1",
        rank=3,
        occurred_at=100.0,
        evidence={"phase": "train", **evidence},
    )


def dead(key: str, job: str = "j", restart: int = 0, occurred_at: float = 100.0) -> Finding:
    return Finding(RANK_DEAD, key, "critical", "rank 1 exited", job, "n1", 1, occurred_at,
                   {"restart": restart})  # fmt: skip


@pytest.fixture
def store(tmp_path):
    s = IncidentStore(tmp_path / "incidents.db")
    yield s
    s.close()


def test_round_trip(store):
    inc, created = store.upsert_finding(
        hang(loss=float("nan")), now=102.5, restart_before=1, step_at_detect=40, checkpoint_step=30
    )
    assert created and inc.state == "open"
    assert (inc.kind, inc.job, inc.node, inc.rank) == (RANK_HUNG, "j", "n1", 3)
    assert (inc.restart_before, inc.step_at_detect, inc.checkpoint_step) == (1, 40, 30)
    assert inc.evidence == {"phase": "train", "loss": "NaN"}  # standard JSON, agent spelling
    assert store.get(inc.id) == inc == store.by_key("hang:j:0:3")
    assert store.get(999) is None and store.by_key("nope") is None
    d = inc.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["time_to_detect"] == pytest.approx(2.5) and d["time_to_recover"] is None


def test_same_finding_twice_is_one_incident(store):
    first, created = store.upsert_finding(hang(), now=101.0, restart_before=0)
    again, created_again = store.upsert_finding(hang(culprit=3), now=105.0, restart_before=4)
    assert created and not created_again and again.id == first.id
    assert again.evidence["culprit"] == 3  # refined evidence is kept ...
    assert (again.detected_at, again.restart_before) == (101.0, 0)  # ... detection facts too
    assert len(store.list_incidents()) == 1


def test_evidence_defaults_fill_detection_facts(store):
    inc, _ = store.upsert_finding(hang(restart=2, step=17, checkpoint_step=10), now=101.0)
    assert (inc.restart_before, inc.step_at_detect, inc.checkpoint_step) == (2, 17, 10)


def test_a_step_known_only_on_a_later_look_is_the_step_at_detection(store):
    """A dead zero-code worker's optimizer count can reach the supervisor a look after its
    death was announced: the incident takes it then, and never changes a known one."""
    inc, _ = store.upsert_finding(hang(restart=0), now=101.0)
    assert inc.step_at_detect is None
    inc, _ = store.upsert_finding(hang(restart=0, step=40), now=101.5)
    assert inc.step_at_detect == 40
    inc, _ = store.upsert_finding(hang(restart=0, step=44), now=102.0)
    assert inc.step_at_detect == 40


def test_action_intent_then_completion(store):
    inc, _ = store.upsert_finding(hang(), now=101.0)
    assert not store.has_action(inc.id, ACT_KILL_RANK)
    aid = store.begin_action(inc.id, ACT_KILL_RANK, {"node": "n1", "job": "j", "rank": 3}, 102.0)
    inc = store.get(inc.id)
    assert (inc.state, inc.action, inc.acted_at) == ("acting", ACT_KILL_RANK, 102.0)
    assert store.has_action(inc.id, ACT_KILL_RANK) and store.has_action(inc.id)
    assert [a.id for a in store.pending_actions()] == [aid]
    with pytest.raises(ActionExists):
        store.begin_action(inc.id, ACT_KILL_RANK, {}, 103.0)
    done = store.complete_action(aid, ok=True, now=102.3, result={"signal": 9})
    assert (done.ok, done.completed_at, done.result, done.target["rank"]) == (
        True, 102.3, {"signal": 9}, 3,
    )  # fmt: skip
    assert store.pending_actions() == []
    failed = store.complete_action(aid, ok=False, now=102.4, error="agent unreachable")
    assert (failed.ok, failed.error) == (False, "agent unreachable")


def test_has_action_survives_a_supervisor_restart(tmp_path):
    path = tmp_path / "incidents.db"
    s = IncidentStore(path)
    inc, _ = s.upsert_finding(hang(), now=101.0)
    s.begin_action(inc.id, ACT_KILL_RANK, {"rank": 3}, 102.0)
    s.close()  # crashed mid-action: intent written, never completed
    s = IncidentStore(path)
    try:
        again, created = s.upsert_finding(hang(), now=200.0)
        assert not created and s.has_action(again.id, ACT_KILL_RANK)
        assert [a.incident_id for a in s.pending_actions()] == [inc.id]
        with pytest.raises(ActionExists):
            s.begin_action(again.id, ACT_KILL_RANK, {"rank": 3}, 201.0)
    finally:
        s.close()


def test_lifecycle_and_timings(store):
    inc, _ = store.upsert_finding(hang(), now=102.0, step_at_detect=40)
    store.begin_action(inc.id, ACT_KILL_RANK, {"rank": 3}, 103.0)
    store.set_state(inc.id, "recovering", 110.0, restarted_at=110.0)
    inc = store.set_state(inc.id, "resolved", 125.0, first_step_at=125.0, resumed_step=30)
    assert (inc.state, inc.resolved_at, inc.lost_steps) == ("resolved", 125.0, 10)
    assert inc.time_to_detect == 2.0 and inc.time_to_recover == 25.0
    assert inc.phases() == {"detect": 2.0, "act": 1.0, "restart": 7.0, "first_step": 15.0}
    with pytest.raises(InvalidTransition):
        store.set_state(inc.id, "acting", 130.0)  # terminal stays terminal
    with pytest.raises(ValueError, match="cannot set"):
        store.set_state(inc.id, "resolved", 130.0, key="x")
    with pytest.raises(ValueError, match="unknown incident state"):
        store.set_state(inc.id, "bogus", 130.0)


def test_dead_rank_recovers_without_an_act_phase(store):
    inc, _ = store.upsert_finding(dead("dead:j:0:1"), now=100.5)
    store.set_state(inc.id, "recovering", 104.0, restarted_at=104.0)
    inc = store.set_state(inc.id, "resolved", 106.0, first_step_at=106.0)
    assert inc.phases() == {"detect": 0.5, "act": None, "restart": 3.5, "first_step": 2.0}


def test_open_incidents_and_list(store):
    a, _ = store.upsert_finding(hang("h1", job="a"), now=1.0)
    b, _ = store.upsert_finding(hang("h2", job="b"), now=2.0)
    c, _ = store.upsert_finding(hang("h3", job="a"), now=3.0)
    store.set_state(c.id, "reported", 4.0)
    store.set_state(a.id, "stopped", 5.0, verdict="crash loop")
    assert [i.key for i in store.open_incidents()] == ["h2", "h3"]
    assert [i.key for i in store.open_incidents(job="a")] == ["h3"]
    assert [i.key for i in store.list_incidents()] == ["h3", "h2", "h1"]
    assert [i.key for i in store.list_incidents(limit=1, job="a")] == ["h3"]
    assert store.get(a.id).verdict == "crash loop" and store.get(a.id).resolved_at == 5.0


def test_events_are_the_timeline_in_order(store):
    inc, _ = store.upsert_finding(hang(), now=102.0)
    aid = store.begin_action(inc.id, ACT_KILL_RANK, {"rank": 3}, 103.0)
    store.add_event(inc.id, "stacks captured", 102.5, {"ranks": [0, 1, 2, 3]})
    store.complete_action(aid, ok=True, now=103.2)
    store.set_state(inc.id, "recovering", 110.0, restarted_at=110.0)
    whats = [e.what for e in store.events(inc.id)]
    assert whats == [
        "detected", "stacks captured", "kill_rank requested", "acting", "kill_rank done",
        "recovering",
    ]  # fmt: skip
    assert store.events(inc.id)[1].detail == {"ranks": [0, 1, 2, 3]}


def test_sqlite_settings(store, tmp_path):
    raw = sqlite3.connect(tmp_path / "incidents.db")
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        version = raw.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        assert int(version) == SCHEMA_VERSION
    finally:
        raw.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "incidents.db"
    IncidentStore(path).close()
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    raw.close()
    with pytest.raises(
        StoreError, match=rf"schema version {SCHEMA_VERSION + 1} is newer.*upgrade rankguard"
    ):
        IncidentStore(path)


def test_not_sqlite_is_a_clear_error(tmp_path):
    path = tmp_path / "incidents.db"
    path.write_bytes(b"this is a text file, not a database\n" * 200)
    with pytest.raises(StoreError, match="incidents.db.*not a usable SQLite"):
        IncidentStore(path)
    assert path.read_bytes().startswith(b"this is a text file")  # left as it was


def test_foreign_sqlite_database_is_refused(tmp_path):
    path = tmp_path / "other.db"
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("CREATE TABLE things (x)")
    raw.close()
    with pytest.raises(StoreError, match="not a rankguard incident store"):
        IncidentStore(path)


def test_failed_write_leaves_nothing_behind(store):
    inc, _ = store.upsert_finding(hang(), now=1.0)
    with pytest.raises(KeyError):
        store.begin_action(999, ACT_KILL_RANK, {}, 2.0)
    store.set_state(inc.id, "recovering", 2.0, restarted_at=2.0)
    with pytest.raises(InvalidTransition):
        store.set_state(inc.id, "acting", 3.0, verdict="must not stick")
    inc = store.get(inc.id)
    assert (inc.state, inc.verdict) == ("recovering", None) and not store.has_action(inc.id)
    assert [e.what for e in store.events(inc.id)] == ["detected", "recovering"]


def test_two_threads_write_concurrently(store):
    errors: list[BaseException] = []
    won: list[int] = []
    shared, _ = store.upsert_finding(hang("shared"), now=0.0)
    barrier = threading.Barrier(2)

    def writer(name: str) -> None:
        try:
            barrier.wait()
            for i in range(40):
                inc, _ = store.upsert_finding(hang(f"{name}:{i}"), now=float(i))
                store.upsert_finding(hang(f"common:{i}"), now=float(i))
                store.add_event(inc.id, "poll", float(i))
            with contextlib.suppress(ActionExists):
                won.append(store.begin_action(shared.id, ACT_KILL_RANK, {}, 1.0))
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store.list_incidents(limit=1000)) == 1 + 40 + 40 + 40
    assert len(won) == 1 and len(store.actions(shared.id)) == 1


def test_build_view(store):
    # Job j: rank 1 died in incarnation 0 (checkpoint 10), we killed a hang in incarnation 1.
    d0, _ = store.upsert_finding(dead("dead:j:0:1", restart=0), 100.0, checkpoint_step=10)
    h1, _ = store.upsert_finding(hang("hang:j:1", restart=1), 200.0, checkpoint_step=10)
    store.begin_action(h1.id, ACT_KILL_RANK, {"rank": 3}, 201.0)
    store.upsert_finding(hang("hang:j:2", restart=2), 300.0)  # not acted: not a restart
    store.upsert_finding(hang("other", job="k"), 300.0)
    findings = [hang("hang:j:2"), dead("dead:j:2:1", restart=2)]
    view = build_view(store, findings, PolicyConfig(), now=400.0, checkpoint_steps={"j": 10})
    assert set(view.incidents) == {"hang:j:2"} and not view.incidents["hang:j:2"].acted
    jv = view.jobs["j"]
    assert [(r.key, r.restart, r.checkpoint_step) for r in jv.restarts] == [
        ("dead:j:0:1", 0, 10), ("hang:j:1", 1, 10),
    ]  # fmt: skip
    assert jv.restart_actions == (201.0,) and jv.stopped_at is None and jv.checkpoint_step == 10
    later = build_view(store, findings, PolicyConfig(budget_window_seconds=100), now=400.0)
    assert later.jobs["j"].restart_actions == ()  # outside the budget window
    store.begin_action(d0.id, ACT_STOP_JOB, {"job": "j"}, 410.0)
    assert build_view(store, findings, PolicyConfig(), 420.0).jobs["j"].stopped_at == 410.0


def test_a_later_view_of_an_earlier_death_renames_the_culprit_until_acted_on(store):
    """Nodes are polled at different moments: torchrun's teardown of rank 1 can be seen
    before the first death (rank 5, on a node read later). The incident follows the
    earliest death; when it was detected does not change."""
    first, created = store.upsert_finding(dead("rank_dead:j:0", occurred_at=100.2), now=100.5)
    assert created and (first.rank, first.occurred_at) == (1, 100.2)
    earlier = dataclasses.replace(dead("rank_dead:j:0", occurred_at=100.0), node="n2", rank=5)
    inc, created = store.upsert_finding(earlier, now=100.8)
    assert not created
    assert (inc.node, inc.rank, inc.occurred_at, inc.detected_at) == ("n2", 5, 100.0, 100.5)
    later = dataclasses.replace(dead("rank_dead:j:0", occurred_at=100.3), node="n3", rank=7)
    assert store.upsert_finding(later, now=101.0)[0].rank == 5  # not an earlier fault

    hung, _ = store.upsert_finding(hang(), now=101.0)
    store.begin_action(hung.id, ACT_KILL_RANK, {"rank": 3}, 102.0)
    other = dataclasses.replace(hang(), rank=4, occurred_at=99.0)
    assert store.upsert_finding(other, now=103.0)[0].rank == 3  # acted on rank 3: it stays


def test_jobs_survive_a_restart_and_a_version_1_file_is_migrated(tmp_path):
    from rankguard.supervisor.lifecycle import JobProgress

    path = tmp_path / "incidents.db"
    with IncidentStore(path) as s:
        p = JobProgress("j", first_seen=100.0, max_step=40, useful_seconds=3.5,
                        state="stopped", verdict="crash loop")  # fmt: skip
        s.save_job(p, now=150.0)
        s.save_job(dataclasses.replace(p, max_step=41, useful_seconds=3.6), now=151.0)
    with IncidentStore(path) as s:  # a restarted supervisor reads where it was
        assert s.jobs() == {"j": JobProgress("j", 100.0, 41, 3.6, "stopped", "crash loop")}
    raw = sqlite3.connect(path)  # as version 1 left it: no jobs table, no causes
    with raw:
        raw.execute("DROP TABLE jobs")
        for column in ("cause", "cause_confidence", "cause_why"):
            raw.execute(f"ALTER TABLE incidents DROP COLUMN {column}")
        raw.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    raw.close()
    with IncidentStore(path) as s:
        assert s.jobs() == {}
        s.save_job(p, now=150.0)
        assert list(s.jobs()) == ["j"]
    with sqlite3.connect(path) as raw:
        version = raw.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert int(version[0]) == SCHEMA_VERSION == 3


def test_a_version_2_store_gets_a_cause_for_every_incident_it_holds(tmp_path):
    path = tmp_path / "incidents.db"
    with IncidentStore(path) as s:
        s.upsert_finding(hang(wavefront={"verdict": "behind", "pg": "0", "seq": 7}), now=1.0)
        s.upsert_finding(dead("dead:j:0"), now=2.0)
    with sqlite3.connect(path) as raw:  # as version 2 left it: no cause columns
        for column in ("cause", "cause_confidence", "cause_why"):
            raw.execute(f"ALTER TABLE incidents DROP COLUMN {column}")
        raw.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    with IncidentStore(path) as s:
        got = {i.key: (i.cause, i.cause_confidence) for i in s.list_incidents()}
        assert got == {"hang:j:0:3": ("collective", "medium"), "dead:j:0": ("unknown", "low")}
        assert "collective 7 of group 0" in s.by_key("hang:j:0:3").cause_why


def test_the_cause_follows_the_evidence_until_the_incident_ends(store):
    inc, _ = store.upsert_finding(hang(), now=1.0)
    assert inc.cause == "unknown"
    named = hang(gpu={"uuid": "GPU-1", "xid_recent": {"48": 1}})  # the next pass sees the XID
    inc, _ = store.upsert_finding(named, now=2.0)
    assert (inc.cause, inc.cause_confidence) == ("gpu_memory", "high")
    assert inc.cause_why == "XID 48 on its GPU: double-bit ECC error"


def test_a_transition_writes_state_columns_and_events_at_once(store):
    from rankguard.supervisor.lifecycle import Transition

    inc, _ = store.upsert_finding(hang(), now=100.0)
    store.apply(Transition(inc.id, "recovering", {"restarted_at": 105.0},
                           (("group restarted", {"restart": 1}),)), now=105.0)  # fmt: skip
    got = store.get(inc.id)
    assert (got.state, got.restarted_at) == ("recovering", 105.0)
    assert [e.what for e in store.events(inc.id)] == ["detected", "group restarted", "recovering"]
    assert store.has_event(inc.id, "group restarted") and not store.has_event(inc.id, "x")
    with pytest.raises(InvalidTransition):
        store.apply(Transition(inc.id, "open"), now=106.0)
    assert [e.what for e in store.events(inc.id)][-1] == "recovering"  # nothing half-written
