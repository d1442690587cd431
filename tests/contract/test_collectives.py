"""A rank's flight-recorder wavefront on the wire: the telemetry record's ``collectives``
and ``progress`` (contract/telemetry.py) and the agent's answer that passes them on
(contract/answers.py). Round trips, and refusals that name the field."""

from __future__ import annotations

import json
import time

import pytest

from rankguard.contract.answers import CollectiveAnswer, RankAnswer, RanksAnswer
from rankguard.contract.errors import ContractError
from rankguard.contract.telemetry import (
    MAX_COLLECTIVES,
    MAX_DATAGRAM_BYTES,
    Collective,
    TelemetryError,
    TelemetryRecord,
    decode,
    encode,
)

FRONT = (
    Collective("0", "default_pg", 13, 12, "nccl:all_reduce", "[[2,3]]", 600.0),
    Collective("1", "mesh_tp", 4, 4, None, None, None),
)


def fields(**kw) -> dict:
    f = dict(
        v=1, job="llama", rank=1, local_rank=1, world_size=2, pid=4242, restart=0, step=10,
        phase="train", time=time.time(), step_seconds=0.0, data_wait_seconds=0.0,
        compute_seconds=0.0, comm_seconds=0.0, comm_exposed_seconds=0.0,
        optimizer_seconds=0.0, checkpoint_block_seconds=0.0, tokens_per_second=0.0, mfu=0.0,
        peak_memory_bytes=0, loss=None, checkpoint_step=None,
    )  # fmt: skip
    f.update(kw)
    return f


def wire(**kw) -> dict:
    """A datagram's object with its wavefront as JSON objects."""
    f = fields(**kw)
    if isinstance(f.get("collectives"), (list, tuple)):
        f["collectives"] = [
            c.to_json() if isinstance(c, Collective) else c for c in f["collectives"]
        ]
    return f


def test_an_evidence_record_round_trips():
    rec = TelemetryRecord(**fields(progress=False, collectives=FRONT))
    data = encode(rec)
    obj = json.loads(data)
    assert obj["progress"] is False and obj["collectives"][0] == {
        "pg": "0", "desc": "default_pg", "enqueued": 13, "completed": 12,
        "op": "nccl:all_reduce", "shape": "[[2,3]]", "timeout_s": 600.0,
    }  # fmt: skip
    back = decode(data)
    assert back == rec and back.collectives == FRONT and back.progress is False


def test_a_plain_record_is_progress_and_carries_neither_field():
    rec = TelemetryRecord(**fields())
    assert rec.progress is True and rec.collectives is None
    obj = json.loads(encode(rec))
    assert "progress" not in obj and "collectives" not in obj
    assert decode(json.dumps({**obj, "progress": True}).encode()).progress is True
    # an empty wavefront is none
    assert TelemetryRecord(**fields(collectives=[])).collectives is None


def test_ints_for_a_timeout_are_stored_as_floats():
    c = Collective("0", "", 1, 0, timeout_s=600)
    assert c.timeout_s == 600.0 and type(c.timeout_s) is float


def test_sixteen_busy_groups_fit_one_datagram():
    front = tuple(
        Collective(str(i), "mesh_dp_shard_cp", 10**9, 10**9 - 1, "nccl:_reduce_scatter_base",
                   f"[[{2**24}]]", 600.0)
        for i in range(MAX_COLLECTIVES)
    )  # fmt: skip
    data = encode(TelemetryRecord(**fields(job="j" * 128, progress=False, collectives=front)))
    assert len(data) <= MAX_DATAGRAM_BYTES
    assert decode(data).collectives == front


def test_an_oversized_wavefront_is_refused_as_too_large():
    longest = tuple(
        Collective(f"{i:02d}" + "p" * 62, "d" * 64, 2**63 - 1, 2**63 - 1, "o" * 48, "s" * 64, 1.5)
        for i in range(MAX_COLLECTIVES)
    )
    rec = TelemetryRecord(**fields(collectives=longest))  # valid, but not one datagram
    with pytest.raises(TelemetryError) as e:
        encode(rec)
    assert e.value.reason == "too_large"
    data = json.dumps(wire(collectives=longest)).encode()
    with pytest.raises(TelemetryError) as e:
        decode(data)
    assert e.value.reason == "too_large"


BAD = [
    ("collectives", {}, "bad_type", "collectives"),
    ("collectives", "0", "bad_type", "collectives"),
    ("collectives", [c.to_json() for c in FRONT * 9][:17], "out_of_range", "collectives"),
    ("collectives", [FRONT[0].to_json()] * 2, "out_of_range", "collectives"),  # same group
    ("collectives", [7], "not_object", "collectives[0]"),
    ("progress", "false", "bad_type", "progress"),
    ("progress", 0, "bad_type", "progress"),
    ("progress", None, "bad_type", "progress"),
]
FIELD_BAD = [
    ("pg", "", "out_of_range"),
    ("pg", "p" * 65, "out_of_range"),
    ("pg", "g\n", "out_of_range"),
    ("pg", 0, "bad_type"),
    ("desc", None, "bad_type"),
    ("desc", "d" * 65, "out_of_range"),
    ("enqueued", "13", "bad_type"),
    ("enqueued", 13.0, "bad_type"),
    ("enqueued", True, "bad_type"),
    ("enqueued", -2, "out_of_range"),
    ("completed", 2**63, "out_of_range"),
    ("op", "", "out_of_range"),
    ("op", "o" * 49, "out_of_range"),
    ("op", 5, "bad_type"),
    ("shape", "s" * 65, "out_of_range"),
    ("shape", [[4]], "bad_type"),
    ("timeout_s", 0, "out_of_range"),
    ("timeout_s", -1.0, "out_of_range"),
    ("timeout_s", "NaN", "bad_type"),
    ("timeout_s", True, "bad_type"),
]


@pytest.mark.parametrize(("name", "value", "reason", "field"), BAD)
def test_a_bad_wavefront_or_progress_is_refused(name, value, reason, field):
    data = json.dumps(wire(**{name: value})).encode()
    with pytest.raises(TelemetryError) as e:
        decode(data)
    assert (e.value.reason, e.value.field) == (reason, field), str(e.value)


@pytest.mark.parametrize(("name", "value", "reason"), FIELD_BAD)
def test_a_bad_group_is_refused_naming_its_field(name, value, reason):
    bad = [FRONT[0].to_json(), {**FRONT[1].to_json(), name: value}]
    with pytest.raises(TelemetryError) as e:
        decode(json.dumps(wire(collectives=bad)).encode())
    assert (e.value.reason, e.value.field) == (reason, f"collectives[1].{name}"), str(e.value)
    with pytest.raises(TelemetryError):  # and at construction
        Collective(**{**FRONT[1].to_json(), name: value})


def test_a_group_missing_a_field_is_refused():
    for name in FRONT[0].to_json():
        obj = FRONT[0].to_json()
        del obj[name]
        with pytest.raises(TelemetryError) as e:
            decode(json.dumps(wire(collectives=[obj])).encode())
        assert (e.value.reason, e.value.field) == ("missing_field", f"collectives[0].{name}")


# --------------------------------------------------------------------------- the answer


def answer(**kw) -> dict:
    rank = RankAnswer(job="j", rank=1, local_rank=1, world_size=2, pid=10, restart=0,
                      state="alive", step=5, phase="train", **kw)  # fmt: skip
    return json.loads(json.dumps(RanksAnswer(node="n", time=1.0, ranks=(rank,)).to_json()))


def test_the_agents_answer_carries_the_wavefront_and_its_age():
    assert CollectiveAnswer is Collective  # the rank's report, passed on: one definition
    obj = answer(collectives=FRONT, collectives_age_seconds=1.5)
    r = obj["ranks"][0]
    assert r["collectives"] == [c.to_json() for c in FRONT]
    assert r["collectives_age_seconds"] == 1.5
    for read in (RankAnswer.from_json, RankAnswer._read):  # the fast path and the checked
        got = read(r)
        assert got.collectives == FRONT and got.collectives_age_seconds == 1.5
    # none: left out, and read as none (an older agent's answer too)
    plain = answer()["ranks"][0]
    assert "collectives" not in plain and "collectives_age_seconds" not in plain
    got = RankAnswer.from_json(plain)
    assert got.collectives == () and got.collectives_age_seconds is None


def test_a_zero_code_workers_script_step_is_carried_and_checked():
    r = answer(script_step=137)["ranks"][0]
    assert r["script_step"] == 137
    for read in (RankAnswer.from_json, RankAnswer._read):
        assert read(r).script_step == 137
    assert "script_step" not in answer()["ranks"][0]  # unknown: left out, read as None
    assert RankAnswer.from_json(answer()["ranks"][0]).script_step is None
    for bad in (-1, "7", True, 1.5):
        with pytest.raises(ContractError) as e:
            RankAnswer.from_json({**r, "script_step": bad})
        assert e.value.field == "script_step"


@pytest.mark.parametrize(("name", "value", "reason"), FIELD_BAD)
def test_an_agents_bad_wavefront_is_refused_naming_its_field(name, value, reason):
    obj = answer(collectives=FRONT, collectives_age_seconds=1.5)
    obj["ranks"][0]["collectives"][1][name] = value
    with pytest.raises(ContractError) as e:
        RanksAnswer.from_json(obj)
    assert (e.value.reason, e.value.field) == (reason, f"ranks[0].collectives[1].{name}")


@pytest.mark.parametrize(
    ("value", "reason"),
    [({}, "bad_type"), ([FRONT[0].to_json()] * 17, "out_of_range"),
     ([FRONT[0].to_json()] * 2, "out_of_range")],
)  # fmt: skip
def test_an_agents_bad_wavefront_list_is_refused(value, reason):
    obj = answer()
    obj["ranks"][0]["collectives"] = value
    with pytest.raises(ContractError) as e:
        RanksAnswer.from_json(obj)
    assert (e.value.reason, e.value.field) == (reason, "ranks[0].collectives")


def test_an_agents_bad_age_is_refused():
    obj = answer(collectives=FRONT, collectives_age_seconds=1.5)
    obj["ranks"][0]["collectives_age_seconds"] = "old"
    with pytest.raises(ContractError) as e:
        RanksAnswer.from_json(obj)
    assert e.value.field == "ranks[0].collectives_age_seconds"
