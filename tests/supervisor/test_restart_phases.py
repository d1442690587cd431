"""A restart split into phases from the workers' startup milestones (pure)."""

from __future__ import annotations

import json

import pytest

from rankguard.supervisor.restart_phases import PHASES, milestones, parse_lines, phases

EVENTS = ("process_start", "imported", "process_group", "built", "resumed", "first_step")


def worker(rank: int, pid: int, t0: float, job="j", incarnation=1, skip=()) -> list[dict]:
    """One worker's lines, 1 s apart from t0; job and incarnation from "built" on, as the
    trainer writes them (it learns its incarnation only with the process group)."""
    out = []
    for k, event in enumerate(EVENTS):
        if event in skip:
            continue
        line = {"rank": rank, "restart": 1, "pid": pid, "event": event, "time": t0 + k}
        if k >= EVENTS.index("built"):
            line.update(job=job, incarnation=incarnation)
        out.append(line)
    return out


def test_each_milestone_is_the_slowest_ranks_and_phases_add_up():
    lines = worker(0, 100, 10.0) + worker(1, 101, 10.5)
    m = milestones(lines, "j", 1, world_size=2)
    assert m == {"process_start": 10.5, "imported": 11.5, "process_group": 12.5,
                 "built": 13.5, "resumed": 14.5, "first_step": 15.5}  # fmt: skip
    p = phases(doomed_at=9.0, old_exited_at=9.25, m=m)
    assert list(p) == list(PHASES)
    assert p == {"teardown": 0.25, "respawn": 1.25, "imports": 1.0, "rendezvous": 1.0,
                 "build": 1.0, "state_load": 1.0, "first_step": 1.0}  # fmt: skip
    assert sum(p.values()) == pytest.approx(m["first_step"] - 9.0)


def test_incomplete_until_every_rank_reached_its_first_step():
    lines = worker(0, 100, 10.0) + worker(1, 101, 10.0, skip=("first_step",))
    assert milestones(lines, "j", 1, world_size=2) is None
    assert milestones(worker(0, 100, 10.0), "j", 1, world_size=2) is None  # rank 1 not started


def test_other_incarnations_and_jobs_are_not_mixed_in():
    old = worker(0, 50, 0.0, incarnation=0) + worker(1, 51, 0.0, incarnation=0)
    other_job = worker(0, 60, 20.0, job="k") + worker(1, 61, 20.0, job="k")
    new = worker(0, 100, 10.0) + worker(1, 101, 10.0)
    m = milestones(old + other_job + new, "j", 1, world_size=2)
    assert m["process_start"] == 10.0 and m["first_step"] == 15.0


def test_without_the_old_ranks_exit_teardown_and_respawn_are_one_span():
    m = milestones(worker(0, 100, 10.0), "j", 1, world_size=1)
    p = phases(doomed_at=8.0, old_exited_at=None, m=m)
    assert p["teardown"] is None and p["respawn"] == 2.0
    # an exit time outside [doomed, respawned] (another clock) is not trusted either
    assert phases(doomed_at=8.0, old_exited_at=11.0, m=m)["teardown"] is None


def test_torn_and_foreign_lines_are_skipped():
    good = worker(0, 100, 10.0)
    text = "\n".join(json.dumps(x) for x in good) + '\n{"rank": 0, "ev\n[1, 2]\n{"event": 3}\n'
    assert parse_lines(text) == good
