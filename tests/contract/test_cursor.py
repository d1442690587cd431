"""Incremental /v1/ranks reads, agent side: cursors, the samples after one, the window's
overflow, foreign and malformed cursors, and the query string at the HTTP layer."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankguard.agent.config import AgentConfig
from rankguard.agent.daemon import Agent
from rankguard.agent.nvml_double import NvmlDouble, make_double
from rankguard.agent.ranks import RankTable
from rankguard.contract.cursor import (
    MAX_SEQ,
    START,
    CursorError,
    Since,
    format_cursor,
    parse_cursor,
    since,
)
from rankguard.contract.telemetry import TelemetryRecord

PID = os.getpid()


def rec(step: int, rank: int = 0, step_seconds: float = 0.5, **kw) -> TelemetryRecord:
    f = dict(
        v=1, job="j", rank=rank, local_rank=rank, world_size=4, pid=PID, restart=0,
        step=step, phase="train", time=0.0, step_seconds=step_seconds,
        data_wait_seconds=0.01, compute_seconds=0.3, comm_seconds=0.1,
        comm_exposed_seconds=0.0, optimizer_seconds=0.0, checkpoint_block_seconds=0.0,
        tokens_per_second=1.0, mfu=0.1, peak_memory_bytes=1, loss=2.0, checkpoint_step=None,
    )  # fmt: skip
    f.update(kw)
    return TelemetryRecord(**f)


@pytest.fixture
def table():
    t = RankTable()
    yield t
    t.close()


def steps(answer: dict, rank: int = 0) -> list[int]:
    r = next(r for r in answer["ranks"] if r["rank"] == rank)
    return [s["step"] for s in r["recent"]]


# --------------------------------------------------------------------------- cursor


def test_since_cases():
    inc = "00ff"
    assert since(None, inc, 10) is None  # the legacy answer
    assert since(START, inc, 10) == Since(0, START)
    assert since(format_cursor(inc, 7), inc, 10) == Since(7, None)
    assert since(format_cursor(inc, 10), inc, 10) == Since(10, None)
    assert since("abcd-7", inc, 10).full.startswith("cursor from another agent incarnation")
    assert since(format_cursor(inc, 11), inc, 10).full.startswith("cursor ahead")
    assert parse_cursor(format_cursor("1b2c", MAX_SEQ)) == ("1b2c", MAX_SEQ)


@pytest.mark.parametrize(
    "bad",
    ["", "zz", "abc", "abc-", "-1", "ABC-1", "abc-1x", "abc--1", "abc-1 ", " abc-1",
     "a" * 33 + "-1", "abc-" + "9" * 20, f"abc-{MAX_SEQ + 1}", "abc-١٢", "START"],
)  # fmt: skip
def test_malformed_cursors_are_refused(bad):
    with pytest.raises(CursorError, match="after: "):
        since(bad, "abc", 10)


@given(st.text(max_size=60))
def test_any_text_is_a_cursor_or_refused(text):
    try:
        s = since(text, "abc", 10)
    except CursorError:
        return
    assert s is not None and 0 <= s.seq <= 10


# --------------------------------------------------------------------------- table


def read(t: RankTable, after: str | None, now: float | None = None) -> dict:
    """The table's /v1/ranks answer as JSON."""
    return t.read(after, now).to_json()


def test_samples_after_a_cursor(table):
    for step in range(1, 6):
        table.update(rec(step), PID)
    first = read(table, START)
    assert first["full"] and first["full_reason"] == START
    assert steps(first) == [1, 2, 3, 4, 5]
    [r] = first["ranks"]
    assert [s["seq"] for s in r["recent"]] == [1, 2, 3, 4, 5] and r["recent_from"] == 1
    table.update(rec(6), PID)
    table.update(rec(6, step_seconds=0.0, phase="checkpoint_save"), PID)  # a heartbeat
    table.update(rec(7), PID)
    second = read(table, first["cursor"])
    assert not second["full"] and second["full_reason"] is None
    assert steps(second) == [6, 7]  # heartbeats are not samples, as in full reads
    assert second["ranks"][0]["step"] == 7 and second["ranks"][0]["recent_from"] == 1
    third = read(table, second["cursor"])  # nothing new
    assert steps(third) == [] and third["cursor"] == second["cursor"]


def test_the_legacy_answer_is_unchanged(table):
    table.update(rec(1), PID, now=100.0)
    legacy = read(table, None, now=101.0)
    assert not {"cursor", "full", "full_reason"} & set(legacy)
    [r] = legacy["ranks"]
    assert "recent_from" not in r and "seq" not in r["recent"][0]
    assert legacy["ranks"] == table.snapshot(now=101.0)


def test_window_overflow(table):
    """More samples between two reads than the 64-deep window holds: the answer is the
    whole window, and recent_from moves up with it."""
    for step in range(1, 11):
        table.update(rec(step), PID)
    cursor = read(table, START)["cursor"]
    for step in range(11, 111):
        table.update(rec(step), PID)
    after = read(table, cursor)
    assert not after["full"]
    assert steps(after) == list(range(47, 111))  # the window: the last 64
    [r] = after["ranks"]
    assert r["recent_from"] == r["recent"][0]["seq"] == 47
    assert steps(read(table, None)) == list(range(47, 111))


def test_window_shrunk_by_heartbeats():
    """Step samples pushed out of the history by heartbeats: recent_from says so even
    when nothing is new."""
    with RankTable(history=8) as t:
        for step in range(1, 6):
            t.update(rec(step), PID)
        first = read(t, START)
        for _ in range(6):
            t.update(rec(5, step_seconds=0.0, phase="checkpoint_save"), PID)
        after = read(t, first["cursor"])
        assert steps(after) == []
        assert after["ranks"][0]["recent_from"] == 4  # steps 4 and 5 are still kept
        assert steps(read(t, None)) == [4, 5]


def test_foreign_and_future_cursors_answer_in_full(table):
    table.update(rec(1), PID)
    table.update(rec(2), PID)
    with RankTable() as other:  # another agent process: another incarnation
        other.update(rec(9), PID)
        foreign = read(other, START)["cursor"]
    full = read(table, foreign)
    assert full["full"] and "incarnation" in full["full_reason"]
    assert steps(full) == [1, 2]
    ahead = read(table, format_cursor(table.incarnation, 3))
    assert ahead["full"] and steps(ahead) == [1, 2]


def test_restart_keeps_the_window_and_numbers_go_on(table):
    table.update(rec(1), PID)
    cursor = read(table, START)["cursor"]
    table.update(rec(1, restart=1), PID)  # torchrun restarted the group from step 0
    answer = read(table, cursor)
    assert [(s["restart"], s["step"], s["seq"]) for s in answer["ranks"][0]["recent"]] == [
        (1, 1, 2)
    ]


# --------------------------------------------------------------------------- HTTP


@pytest.fixture
def agent(tmp_path):
    cfg = AgentConfig(bind="127.0.0.1:0", interval=0.2, node="cursors",
                      telemetry_socket=str(tmp_path / "t.sock"))  # fmt: skip
    a = Agent(cfg, nvml=NvmlDouble(make_double(n_gpus=1)))
    a.collect_once()
    host, port = a.start_http()
    a.base = f"http://{host}:{port}"
    a.table.update(rec(1), PID)
    yield a
    a.close()


def get(agent, query: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(agent.base + "/v1/ranks" + query, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    "query",
    ["?after=zz", "?after=", "?after=abc-99999999999999999999999", "?after=start&after=start",
     "?after=%FF", "?after=" + "a" * 3000, "?" + "&".join(f"x{i}=1" for i in range(40))],
)  # fmt: skip
def test_hostile_queries_get_a_400(agent, query):
    status, body = get(agent, query)
    assert status == 400, body
    assert body["error"]["status"] == 400 and body["error"]["message"]


def test_http_incremental_reads(agent):
    status, legacy = get(agent, "")
    assert status == 200 and "cursor" not in legacy and "seq" not in legacy["ranks"][0]["recent"][0]
    assert "cursor" not in get(agent, "?unknown=1")[1]  # other parameters are ignored
    _, first = get(agent, "?after=start")
    assert first["full"] and steps(first) == [1]
    agent.table.update(rec(2), PID)
    _, second = get(agent, "?after=" + first["cursor"])
    assert not second["full"] and steps(second) == [2]


def test_answers_are_compact_json(agent):
    with urllib.request.urlopen(agent.base + "/v1/ranks", timeout=10) as resp:
        body = resp.read()
    assert b"\n " not in body and b'", "' not in body and body.endswith(b"}\n")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_reads_between_bursts_see_every_sample_once(bursts):
    """Reading after every burst of records: each sample arrives exactly once and in
    order, as long as a burst fits the window."""
    with RankTable(recent=40) as t:
        cursor, seen, step = START, [], 0
        for n in bursts:
            for _ in range(n):
                step += 1
                t.update(rec(step), PID)
            answer = read(t, cursor)
            seen += steps(answer)
            cursor = answer["cursor"]
        assert seen == list(range(1, step + 1))
