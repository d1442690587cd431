"""The agent's /v1/rank-events buffer: cursors, the bounded buffer, the held wait, the
waiter cap, the `wait` parameter (agent/rank_events.py; pure apart from the clock)."""

from __future__ import annotations

import threading
import time

import pytest

from rankguard.agent.rank_events import Busy, RankEventLog, parse_states, parse_wait
from rankguard.agent.ranks import RankEvent
from rankguard.contract.cursor import CursorError


def death(rank: int, pid: int = 100, at: float = 1.0) -> RankEvent:
    return RankEvent("j", rank, pid, "alive", "exited", at, None, 3)


def test_a_cursor_reads_only_what_is_new():
    log = RankEventLog()
    first = log.read("start", 0)
    assert first.full and first.events == ()
    log.add(death(0))
    log.add(death(1))
    a = log.read(first.cursor, 0)
    assert not a.full and [(e.rank, e.state, e.restart) for e in a.events] == [
        (0, "exited", 3),
        (1, "exited", 3),
    ]
    log.add(death(2))
    b = log.read(a.cursor, 0)
    assert [e.rank for e in b.events] == [2] and b.events[0].seq == 3
    assert log.read(b.cursor, 0).events == ()


def test_a_cursor_that_fell_out_of_the_buffer_gets_full():
    log = RankEventLog(capacity=2)
    c = log.read("start", 0).cursor
    for r in range(5):
        log.add(death(r))
    a = log.read(c, 0)
    assert a.full and "buffer" in a.full_reason
    assert [e.rank for e in a.events] == [3, 4]
    # the cursor just before the oldest kept event is still exact
    assert not log.read(f"{log.incarnation}-3", 0).full


def test_a_foreign_or_future_cursor_gets_full_and_garbage_is_refused():
    log = RankEventLog()
    log.add(death(0))
    assert log.read("0123abcd-1", 0).full  # another agent's incarnation (a restart)
    assert log.read(f"{log.incarnation}-99", 0).full  # ahead of this agent
    with pytest.raises(CursorError):
        log.read("not a cursor", 0)


def test_a_held_read_answers_at_the_next_event():
    log = RankEventLog()
    c = log.read("start", 0).cursor
    threading.Timer(0.2, log.add, (death(5),)).start()
    t0 = time.monotonic()
    a = log.read(c, 10)
    took = time.monotonic() - t0
    assert [e.rank for e in a.events] == [5]
    assert 0.15 < took < 2.0


def test_a_held_read_ends_after_wait_with_nothing():
    log = RankEventLog()
    c = log.read("start", 0).cursor
    t0 = time.monotonic()
    a = log.read(c, 0.2)
    assert a.events == () and a.cursor == c and 0.15 < time.monotonic() - t0 < 2.0


def test_new_events_are_answered_without_waiting():
    log = RankEventLog()
    c = log.read("start", 0).cursor
    log.add(death(1))
    t0 = time.monotonic()
    assert len(log.read(c, 10).events) == 1
    assert time.monotonic() - t0 < 5.0  # not the 10 s a read with nothing new waits


def test_a_states_filter_holds_past_other_changes_and_moves_the_cursor():
    """`states=exited,zombie` (the supervisor's): a restart's new ranks neither end the
    held read nor appear; the death does, and the cursor is past everything."""
    log = RankEventLog()
    c = log.read("start", 0).cursor
    deaths = parse_states({"states": "exited,zombie"})
    born = RankEvent("j", 2, 300, "exited", "alive", 1.0, None, 4)
    threading.Timer(0.05, log.add, (born,)).start()
    threading.Timer(0.3, log.add, (death(7),)).start()
    t0 = time.monotonic()
    a = log.read(c, 10, states=deaths)
    assert [(e.rank, e.state) for e in a.events] == [(7, "exited")]
    assert time.monotonic() - t0 > 0.25  # not ended by the birth at 0.05 s
    assert a.cursor.endswith("-2")  # past the birth left out
    assert log.read(a.cursor, 0, states=deaths).events == ()
    assert [e.state for e in log.read(c, 0).events] == ["alive", "exited"]  # unfiltered
    assert parse_states({}) is None
    with pytest.raises(CursorError):
        parse_states({"states": "exited,dead"})


def test_held_reads_are_capped_and_close_releases_them():
    log = RankEventLog(max_waiters=2)
    c = log.read("start", 0).cursor
    out = []
    held = [threading.Thread(target=lambda: out.append(log.read(c, 30))) for _ in range(2)]
    for t in held:
        t.start()
    deadline = time.monotonic() + 5
    while log._waiters < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(Busy) as err:
        log.read(c, 30)
    assert err.value.status == 503 and log.busy == 1
    assert log.read(c, 0).events == ()  # a read that does not wait is always answered
    log.close()
    for t in held:
        t.join(5)
    assert len(out) == 2


@pytest.mark.parametrize("text", ["-1", "31", "nan", "inf", "x", "", "1" * 40])
def test_a_bad_wait_is_refused(text):
    with pytest.raises(CursorError):
        parse_wait({"wait": text})


def test_wait_parses():
    assert parse_wait({}) == 0 and parse_wait({"wait": "2.5"}) == 2.5
