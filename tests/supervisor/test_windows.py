"""Incremental reads, supervisor side: the windows merged from `?after=` answers equal
what full reads would show, over random histories of records, reads and lost answers."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from builders import FAST
from hypothesis import given
from hypothesis import strategies as st

from rankguard.agent.ranks import RankTable, RankTableFullError
from rankguard.contract.answers import NodeAnswer, RankAnswer, RanksAnswer, Sample
from rankguard.contract.errors import ContractError
from rankguard.contract.telemetry import TelemetryRecord
from rankguard.supervisor.state import NodeObs, StepSample
from rankguard.supervisor.windows import NodeWindows

PID = os.getpid()
NODE = NodeAnswer(node="n", version="0", time=0.0, uptime_seconds=0.0, status="healthy")


def wire(answer: RanksAnswer) -> RanksAnswer:
    """The answer as the supervisor reads it: through JSON text and the contract."""
    return RanksAnswer.from_json(json.loads(json.dumps(answer.to_json(), allow_nan=False)))


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


DEAD = _dead_pid()  # a rank sent from it is dead at once: evictable, a process change


def rec(rank: int, step: int, pid: int, restart: int, timed: bool) -> TelemetryRecord:
    return TelemetryRecord(
        v=1, job="j", rank=rank, local_rank=rank, world_size=8, pid=pid, restart=restart,
        step=step, phase="train" if timed else "checkpoint_save", time=0.0,
        step_seconds=0.1 + step / 1000 if timed else 0.0, data_wait_seconds=0.0,
        compute_seconds=0.08, comm_seconds=0.01, comm_exposed_seconds=0.0,
        optimizer_seconds=0.0, checkpoint_block_seconds=0.0, tokens_per_second=1.0, mfu=0.1,
        peak_memory_bytes=1, loss=float(step), checkpoint_step=None,
    )  # fmt: skip


def full_windows(table: RankTable) -> dict[tuple[str, int], tuple[StepSample, ...]]:
    """What the supervisor sees with full reads (the legacy answer)."""
    obs = NodeObs.of("u", NODE, wire(table.read(None, now=0.0)), 0.0)
    return {r.key: r.recent for r in obs.ranks}


op = st.one_of(
    st.tuples(st.just("send"), st.integers(0, 4), st.integers(1, 30), st.booleans(),
              st.sampled_from([PID, DEAD]), st.integers(0, 2)),
    st.tuples(st.just("poll")),
    st.tuples(st.just("lost")),  # an answer that never reached the supervisor
)  # fmt: skip


@FAST
@given(
    ops=st.lists(op, max_size=60),
    history=st.integers(4, 40),
    recent=st.integers(1, 16),
    max_ranks=st.integers(2, 5),
)
def test_merged_windows_equal_full_reads(ops, history, recent, max_ranks):
    """Random bursts of step records and heartbeats on up to 5 ranks (window overflow,
    heartbeats pushing samples out of a short history, process changes, dead ranks
    evicted and registered again), polled incrementally with some answers lost: after
    every poll each rank's merged window is the full read's window."""
    windows = NodeWindows(depth=recent)
    step = 0
    with RankTable(history=history, recent=recent, max_ranks=max_ranks) as table:
        for o in ops:
            if o[0] == "send":
                _, rank, n, timed, pid, restart = o
                for _ in range(n):
                    step += 1
                    try:
                        table.update(rec(rank, step, pid, restart, timed), pid, now=0.0)
                    except RankTableFullError:
                        break
                continue
            answer = wire(table.read(windows.after, now=0.0))
            if o[0] == "lost":
                continue
            merged = windows.merge(answer)
            assert merged == full_windows(table)
        merged = windows.merge(wire(table.read(windows.after, now=0.0)))
        assert merged == full_windows(table)


def answer(cursor, full, ranks):
    return RanksAnswer(node="n", time=0.0, ranks=tuple(ranks), cursor=cursor, full=full)


def rank(r, first, samples):
    recent = tuple(Sample(s, "train", 0, 1, 1.0, 0.0, 0.5, 0.1, None, seq=s) for s in samples)
    return RankAnswer(job="j", rank=r, local_rank=r, world_size=8, pid=1, restart=0,
                      state="alive", recent=recent, recent_from=first)  # fmt: skip


def test_full_answer_replaces_and_overlap_is_ignored():
    w = NodeWindows(depth=4)
    assert w.after == "start"
    assert [s.step for s in w.merge(answer("a-3", True, [rank(0, 1, [1, 2, 3])]))[("j", 0)]] == [
        1, 2, 3,
    ]  # fmt: skip
    assert w.after == "a-3"
    # a repeated or out-of-order sample is taken once; the depth bounds the window
    got = w.merge(answer("a-6", False, [rank(0, 1, [3, 5, 4, 6])]))[("j", 0)]
    assert [s.step for s in got] == [2, 3, 5, 6]
    # an agent restart: its numbers start again, the full answer replaces everything
    got = w.merge(answer("b-2", True, [rank(0, 1, [1, 2])]))[("j", 0)]
    assert [s.step for s in got] == [1, 2] and w.full_reads == 2
    # a rank no longer shown is forgotten; an empty window has no recent_from
    assert w.merge(answer("b-2", False, [rank(1, None, [])])) == {("j", 1): ()}


def test_an_agent_without_cursors():
    w = NodeWindows()
    w.merge(answer("a-3", True, [rank(0, 1, [1, 2, 3])]))
    assert w.merge(answer(None, False, [rank(0, None, [1])])) is None  # use its recent
    assert w.cursor is None and w.after == "start"


def test_a_malformed_answer_changes_nothing():
    w = NodeWindows()
    w.merge(answer("a-3", True, [rank(0, 1, [1, 2, 3])]))
    bad = answer("b-9", True, [rank(0, 1, [1]), rank(1, 1, [1])]).to_json()
    del bad["ranks"][1]["recent"][0]["seq"]  # a sample of an incremental answer without seq
    with pytest.raises(ContractError) as err:
        w.merge(RanksAnswer.from_json(bad))
    assert err.value.field == "ranks[1].recent[0].seq" and err.value.reason == "missing_field"
    assert w.cursor == "a-3" and w.full_reads == 1
    got = w.merge(answer("a-4", False, [rank(0, 1, [4])]))
    assert [s.step for s in got[("j", 0)]] == [1, 2, 3, 4]
