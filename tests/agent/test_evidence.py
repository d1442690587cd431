"""Evidence records: a rank's flight-recorder wavefront, sent while it stalls with
``progress`` false (client/reporter.py). The agent keeps the wavefront and when it came,
and nothing else: the heartbeat ages on, the history, the counters and the step stay as
they were (a hung rank must not look alive). /v1/ranks shows ``collectives`` and
``collectives_age_seconds``; the supervisor reads them into RankObs and ages them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from builders import STEP_RECORD_CHILD, telemetry_fields
from test_agent_api import agent, get_json  # noqa: F401  (the fixture)

from rankguard.agent.ranks import RankTable
from rankguard.contract.answers import CollectiveAnswer, NodeAnswer, RankAnswer, RanksAnswer
from rankguard.contract.cursor import START
from rankguard.contract.telemetry import Collective, TelemetryRecord
from rankguard.supervisor.state import NodeObs, RankObs

FRONT = (
    Collective("0", "default_pg", 13, 12, "gloo:all_reduce", "[[2,3]]", 1800.0),
    Collective("1", "pair", 1, 1, "gloo:all_reduce", "[[4]]", 1800.0),
)

# A rank: one step record, then an evidence record for each line on stdin.
CHILD = (
    STEP_RECORD_CHILD
    + """
front = [{"pg": "0", "desc": "default_pg", "enqueued": 13, "completed": 12,
          "op": "gloo:all_reduce", "shape": "[[2,3]]", "timeout_s": 1800.0},
         {"pg": "1", "desc": "pair", "enqueued": 1, "completed": 1,
          "op": "gloo:all_reduce", "shape": "[[4]]", "timeout_s": 1800.0}]
for line in sys.stdin:
    assert sender.send({**rec, "time": time.time(), "step_seconds": 0.0, "progress": False,
                        "collectives": front})
    print("sent", flush=True)
"""
)


@pytest.fixture
def stalled(agent):  # noqa: F811
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, agent.cfg.telemetry_socket],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "sent"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not agent.table.processes():
        time.sleep(0.01)

    def evidence() -> None:
        proc.stdin.write("e\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "sent"

    yield evidence
    proc.kill()
    proc.wait()


def _rank(agent) -> dict:  # noqa: F811
    status, view = get_json(agent, "/v1/ranks")
    assert status == 200
    (r,) = view["ranks"]
    return r


def _settled(agent, predicate) -> dict:  # noqa: F811
    deadline = time.monotonic() + 5
    while True:
        r = _rank(agent)
        if predicate(r) or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


def test_evidence_is_shown_and_the_heartbeat_ages_on(agent, stalled):  # noqa: F811
    before = _rank(agent)
    assert "collectives" not in before and "collectives_age_seconds" not in before
    time.sleep(0.3)
    for _ in range(3):
        stalled()
        time.sleep(0.1)
    r = _settled(agent, lambda r: "collectives" in r)
    assert r["collectives"] == [c.to_json() for c in FRONT]
    assert 0 <= r["collectives_age_seconds"] < 0.5
    # no progress: the heartbeat kept ageing, nothing of the step moved
    assert r["heartbeat_age_seconds"] >= 0.5
    assert r["last_heartbeat_at"] == before["last_heartbeat_at"]
    for name in ("records_received", "step", "timed_step", "step_seconds", "recent", "phase"):
        assert r[name] == before[name], name
    # the supervisor reads it (fast path and checked read agree) and ages it
    _, view = get_json(agent, "/v1/ranks")
    answer = RanksAnswer.from_json(view)
    assert answer.ranks[0].collectives == FRONT
    assert RankAnswer._read(view["ranks"][0]).collectives == FRONT
    node = NodeAnswer.from_json(get_json(agent, "/v1/node")[1])
    obs = NodeObs.of(agent.base, node, answer, observed_at=100.0)
    (rank,) = obs.ranks
    assert isinstance(rank, RankObs) and rank.collectives == FRONT
    assert isinstance(rank.collectives[0], CollectiveAnswer)
    aged = obs.aged(102.0).ranks[0]
    assert aged.collectives_age_seconds == pytest.approx(rank.collectives_age_seconds + 2.0)
    assert aged.heartbeat_age_seconds == pytest.approx(rank.heartbeat_age_seconds + 2.0)


# --------------------------------------------------------------------------- the table


def _record(**kw) -> TelemetryRecord:
    return TelemetryRecord(**telemetry_fields(world_size=2, **kw))


@pytest.fixture
def table():
    t = RankTable(clock=lambda: 1000.0, wall_clock=lambda: 1000.0)
    yield t
    t.close()


def test_the_table_keeps_evidence_apart_from_progress(table):
    me = os.getpid()
    table.update(_record(), me, now=1000.0)
    first = table.read(START, now=1000.0)  # an incremental read: the cursor's samples
    evidence = _record(step=10, step_seconds=0.0, progress=False, collectives=FRONT)
    table.update(evidence, me, now=1005.0)
    (r,) = table.answers(now=1006.0)
    assert r.collectives == FRONT and r.collectives_age_seconds == pytest.approx(1.0)
    assert r.heartbeat_age_seconds == pytest.approx(6.0)
    assert r.records_received == 1 and len(r.recent) == 1 and r.step_seconds == 2.0
    (_, _, counters), = table.counters()  # fmt: skip
    assert counters.steps == 1
    # no new sample: an incremental reader gets nothing new
    later = table.read(first.cursor, now=1006.0)
    assert later.ranks[0].recent == () and later.ranks[0].collectives == FRONT
    # a progress record later: the heartbeat is fresh, the evidence stays with its age
    table.update(_record(step=11), me, now=1010.0)
    (r,) = table.answers(now=1010.0)
    assert r.heartbeat_age_seconds == 0.0 and r.collectives_age_seconds == pytest.approx(5.0)


def test_evidence_from_a_process_first_seen_registers_it(table):
    table.update(_record(progress=False, collectives=FRONT), os.getpid(), now=1000.0)
    (r,) = table.answers(now=1001.0)
    assert r.state == "alive" and r.collectives == FRONT and r.heartbeat_age_seconds == 1.0


def test_an_evidence_record_without_a_wavefront_says_the_recorder_shows_nothing(table):
    me = os.getpid()
    table.update(_record(collectives=FRONT, progress=False), me, now=1000.0)
    table.update(_record(progress=False), me, now=1002.0)
    (r,) = table.answers(now=1002.0)
    assert r.collectives == () and r.collectives_age_seconds == 0.0
