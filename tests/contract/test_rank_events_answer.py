"""/v1/rank-events as a contract model: round trip, and hostile answers refused with a
reason and the field named (contract/answers.py RankEventsAnswer)."""

from __future__ import annotations

import json

import pytest
from builders import FAST, assert_only_contract_errors, break_one_field, json_values, set_at
from hypothesis import given
from hypothesis import strategies as st

from rankguard.contract import RANK_STATES, ContractError
from rankguard.contract.answers import RankEventAnswer, RankEventsAnswer

events = st.builds(
    RankEventAnswer,
    seq=st.integers(1, 2**40),
    job=st.text(max_size=20),
    rank=st.integers(0, 2**20),
    pid=st.integers(1, 2**22),
    restart=st.none() | st.integers(0, 1000),
    previous=st.none() | st.sampled_from(RANK_STATES),
    state=st.sampled_from(RANK_STATES),
    at=st.floats(0, 2e9),
    detail=st.none() | st.text(max_size=30),
    step=st.none() | st.integers(0, 2**40),
    checkpoint_step=st.none() | st.integers(0, 2**40),
)


@st.composite
def answers(draw):
    evs = draw(st.lists(events, max_size=6, unique_by=lambda e: e.seq))
    evs = sorted(evs, key=lambda e: e.seq)
    full = draw(st.booleans())
    return RankEventsAnswer(
        node=draw(st.text(max_size=10)), time=draw(st.floats(0, 2e9)),
        cursor=draw(st.from_regex(r"[0-9a-f]{16}-[0-9]{1,6}", fullmatch=True)),
        full=full, full_reason=draw(st.text(max_size=20)) if full else None, events=tuple(evs),
    )  # fmt: skip


@FAST
@given(answers())
def test_round_trip(answer):
    assert RankEventsAnswer.from_json(json.loads(json.dumps(answer.to_json()))) == answer


def _good() -> dict:
    # every optional field set: the property test below breaks each by a change of type
    e = RankEventAnswer(3, "j", 1, 42, 0, "alive", "exited", 1700000000.5, "exit code 1", 57, 50)
    return RankEventsAnswer("n", 1.0, "ab-3", events=(e,)).to_json()


@pytest.mark.parametrize(
    ("path", "value", "reason", "field"),
    [
        (("events", 0, "state"), "running", "out_of_range", "events[0].state"),
        (("events", 0, "previous"), 7, "bad_type", "events[0].previous"),
        (("events", 0, "rank"), -1, "out_of_range", "events[0].rank"),
        (("events", 0, "pid"), True, "bad_type", "events[0].pid"),
        (("events", 0, "checkpoint_step"), -1, "out_of_range", "events[0].checkpoint_step"),
        (("events", 0, "checkpoint_step"), "20", "bad_type", "events[0].checkpoint_step"),
        (("events", 0, "seq"), 0, "out_of_range", "events[0].seq"),
        (("events", 0, "at"), "NaN", "bad_type", "events[0].at"),  # only losses may be NaN
        (("events", 0, "job"), "x" * 10_000, "out_of_range", "events[0].job"),
        (("events",), {}, "bad_type", "events"),
        (("events",), [{}] * 5000, "out_of_range", "events"),
        (("cursor",), None, "bad_type", "cursor"),
        (("full",), "yes", "bad_type", "full"),
    ],
)
def test_a_malformed_answer_names_its_field(path, value, reason, field):
    answer = _good()
    set_at(answer, path, value)
    with pytest.raises(ContractError) as err:
        RankEventsAnswer.from_json(answer)
    assert (err.value.reason, err.value.field) == (reason, field), str(err.value)


def test_an_older_agents_event_without_a_checkpoint_step_is_read():
    answer = _good()
    del answer["events"][0]["checkpoint_step"]
    assert RankEventsAnswer.from_json(answer).events[0].checkpoint_step is None


def test_events_out_of_order_are_refused():
    answer = _good()
    answer["events"] = answer["events"] * 2  # the same seq twice
    with pytest.raises(ContractError) as err:
        RankEventsAnswer.from_json(answer)
    assert err.value.field == "events[1].seq"


def test_a_missing_field_is_named():
    answer = _good()
    del answer["events"][0]["state"]
    with pytest.raises(ContractError) as err:
        RankEventsAnswer.from_json(answer)
    assert (err.value.reason, err.value.field) == ("missing_field", "events[0].state")


@FAST
@given(json_values)
def test_no_json_value_raises_anything_but_a_contract_error(value):
    assert_only_contract_errors(RankEventsAnswer, value)


@FAST
@given(st.data())
def test_an_event_with_one_field_broken_is_refused(data):
    answer = _good()
    name, value = break_one_field(data, answer["events"][0])
    try:
        RankEventsAnswer.from_json(answer)
    except ContractError as e:
        assert e.field.startswith("events[0]")
    else:  # null where a field may be null, a number where a float is (at)
        assert value is None or (name == "at" and isinstance(value, (int, float)))
