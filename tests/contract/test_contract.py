"""The contract (rankguard.contract): what crosses a process boundary, written once.

Round trips: every answer a model can hold survives to_json -> JSON text -> from_json
unchanged, non-finite losses included. Rejections: a wrong type, a value out of range, a
missing field or something that is not an object raises ContractError naming the field,
and no JSON value raises anything else. States: one set, one meaning.
"""

from __future__ import annotations

import json
import math

import pytest
from builders import FAST, assert_only_contract_errors, break_one_field, json_values, set_at
from hypothesis import given
from hypothesis import strategies as st

from rankguard.contract import (
    DEAD_STATES,
    ENDED_STATES,
    LIVE_STATES,
    RANK_STATES,
    CollectorStatus,
    ContractError,
    HealthReason,
    NodeAnswer,
    NodeWarning,
    RankAnswer,
    RanksAnswer,
    Sample,
    TelemetryStats,
    decode_float,
    encode_float,
    json_safe,
)
from rankguard.contract.answers import (
    GPU_SOURCES,
    NODE_STATUSES,
    CollectiveAnswer,
    MainThreadAnswer,
    RankGpuAnswer,
    StandInAnswer,
)
from rankguard.contract.states import STAND_IN_STATES
from rankguard.contract.telemetry import PHASES

finite = st.floats(allow_nan=False, allow_infinity=False)
any_float = st.floats()  # NaN and infinities too
counts = st.integers(0, 2**63 - 1)
reason = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)
text = st.text(max_size=30)


def over_json(value: dict) -> dict:
    """As the other process reads it: strict JSON text (no NaN literals) and back."""
    return json.loads(json.dumps(value, allow_nan=False))


def same(a, b) -> bool:
    """Equal as wire data: NaN equals NaN."""
    return json.dumps(a.to_json(), sort_keys=True) == json.dumps(b.to_json(), sort_keys=True)


@st.composite
def samples(draw, incremental: bool) -> Sample:
    return Sample(
        step=draw(counts), phase=draw(st.sampled_from(PHASES)), restart=draw(counts),
        pid=draw(counts), step_seconds=draw(finite), data_wait_seconds=draw(finite),
        compute_seconds=draw(finite), comm_seconds=draw(finite),
        loss=draw(st.none() | any_float), seq=draw(counts) if incremental else None,
        compute_wait_seconds=draw(st.none() | finite),
    )  # fmt: skip


def optional(strategy):
    return st.none() | strategy


@st.composite
def rank_answers(draw, incremental: bool) -> RankAnswer:
    world_size = draw(st.integers(1, 2**63 - 1))
    return RankAnswer(
        job=draw(st.text(min_size=1, max_size=128)),
        rank=draw(st.integers(0, world_size - 1)),
        local_rank=draw(counts),
        world_size=world_size,
        pid=draw(counts),
        restart=draw(counts),
        state=draw(st.sampled_from(RANK_STATES)),
        source=draw(st.sampled_from(("telemetry", "process"))),
        process_changes=draw(counts),
        state_detail=draw(optional(text)),
        state_since=draw(finite),
        exit_code=draw(optional(counts)),
        exited_at=draw(optional(finite)),
        first_seen_at=draw(finite),
        step=draw(optional(counts)),
        phase=draw(optional(st.sampled_from(PHASES))),
        heartbeat_age_seconds=draw(optional(finite)),
        last_heartbeat_at=draw(optional(finite)),
        timed_step=draw(optional(counts)),
        step_seconds=draw(optional(finite)),
        data_wait_seconds=draw(optional(finite)),
        compute_seconds=draw(optional(finite)),
        comm_seconds=draw(optional(finite)),
        comm_exposed_seconds=draw(optional(finite)),
        optimizer_seconds=draw(optional(finite)),
        checkpoint_block_seconds=draw(optional(finite)),
        comm_compute_ratio=draw(optional(finite)),
        tokens_per_second=draw(optional(finite)),
        mfu=draw(optional(finite)),
        loss=draw(optional(any_float)),
        peak_memory_bytes=draw(optional(counts)),
        checkpoint_step=draw(optional(counts)),
        cpu_seconds=draw(optional(finite)),
        cpu_utilization=draw(optional(finite)),
        cpu_active_at=draw(finite),
        records_received=draw(counts),
        client_errors=draw(st.dictionaries(reason, counts, max_size=5)),
        resume_skips=draw(st.sampled_from(((), ((3, 3),), ((1, 8), (10, 2**62))))),
        stand_in=draw(
            optional(
                st.builds(
                    StandInAnswer,
                    pid=st.integers(1, 2**22),
                    state=st.sampled_from(STAND_IN_STATES),
                    state_since=finite,
                )
            )
        ),
        gpu=draw(optional(gpus())),
        main_thread=draw(optional(main_threads())),
        collectives=draw(wavefronts()),
        collectives_age_seconds=draw(optional(finite)),
        recent=tuple(draw(st.lists(samples(incremental), max_size=4))),
        recent_from=draw(optional(counts)) if incremental else None,
    )


def gpus():
    return st.builds(
        RankGpuAnswer,
        uuid=st.from_regex(r"(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}(/[0-9])?", fullmatch=True),
        source=st.sampled_from(GPU_SOURCES),
        index=optional(st.integers(0, 64)),
        lost=st.booleans(),
        xid_recent=st.dictionaries(st.sampled_from(("13", "48", "79")), counts, max_size=3),
        ecc_uncorrected=optional(counts),
        throttle=st.lists(st.sampled_from(("hw_slowdown", "sw_thermal")), max_size=2).map(tuple),
    )


def wavefronts():
    printable = st.text(st.characters(codec="utf-8", categories=("L", "N", "P")), max_size=64)
    return st.lists(
        st.builds(
            CollectiveAnswer,
            pg=printable.filter(bool),
            desc=printable,
            enqueued=st.integers(-1, 2**63 - 1),
            completed=st.integers(-1, 2**63 - 1),
            op=optional(st.sampled_from(("nccl:all_reduce", "gloo:broadcast"))),
            shape=optional(st.sampled_from(("[[4]]", "[]", "[[2,3],[2,3]]"))),
            timeout_s=optional(st.floats(1e-6, 1e9) | st.integers(1, 10**6)),
        ),
        max_size=3,
        unique_by=lambda c: c.pg,
    ).map(tuple)


def main_threads():
    return st.builds(
        MainThreadAnswer,
        state=st.sampled_from("RSDTtZ"),
        run_seconds=finite,
        active_at=finite,
        utilization=optional(finite),
        wchan=optional(st.sampled_from(("futex_wait_queue", "do_epoll_wait")) | text),
        syscall=optional(st.sampled_from(("running", "-1", "202", "7"))),
    )


@st.composite
def ranks_answers(draw) -> RanksAnswer:
    incremental = draw(st.booleans())
    cursor = {}
    if incremental:
        cursor = dict(cursor=draw(text), full=draw(st.booleans()), full_reason=draw(optional(text)))
    return RanksAnswer(
        node=draw(text),
        time=draw(finite),
        ranks=tuple(draw(st.lists(rank_answers(incremental), max_size=3))),
        telemetry=TelemetryStats(
            path=draw(text),
            accepted=draw(counts),
            rejected=draw(st.dictionaries(reason, st.integers(0, 2**40), max_size=4)),
            last_error=draw(st.dictionaries(reason, text, max_size=2)),
        ),
        **cursor,
    )


node_answers = st.builds(
    NodeAnswer,
    node=st.text(max_size=40),
    version=st.text(max_size=20),
    time=finite,
    uptime_seconds=finite,
    status=st.sampled_from(NODE_STATUSES),
    reasons=st.lists(
        st.builds(
            HealthReason,
            code=st.text(max_size=20),
            severity=st.sampled_from(NODE_STATUSES),
            message=text,
        ),  # fmt: skip
        max_size=3,
    ).map(tuple),
    collectors=st.dictionaries(
        st.text(max_size=10),
        st.builds(CollectorStatus, st.booleans(), finite, optional(text)),
        max_size=3,
    ),
    facts=st.dictionaries(st.text(max_size=10), st.dictionaries(st.text(max_size=5), counts)),
    warnings=st.lists(
        st.builds(NodeWarning, code=st.text(max_size=20), message=text), max_size=3
    ).map(tuple),
)


# --------------------------------------------------------------------------- round trips


@FAST
@given(ranks_answers())
def test_ranks_answer_round_trip(answer):
    back = RanksAnswer.from_json(over_json(answer.to_json()))
    assert same(back, answer)
    has_nan = any(
        r.loss is not None
        and math.isnan(r.loss)
        or any(s.loss is not None and math.isnan(s.loss) for s in r.recent)
        for r in answer.ranks
    )
    if not has_nan:  # NaN != NaN: those are compared as wire data above
        assert back == answer


@FAST
@given(node_answers)
def test_node_answer_round_trip(answer):
    assert NodeAnswer.from_json(over_json(answer.to_json())) == answer


@FAST
@given(any_float)
def test_every_float_survives_the_wire(x):
    back = decode_float(over_json({"x": encode_float(x)})["x"], "x", finite=False)
    assert back == x or (math.isnan(back) and math.isnan(x))


def test_non_finite_numbers_have_one_spelling():
    assert [encode_float(x) for x in (math.nan, math.inf, -math.inf, 1.5, None)] == [
        "NaN", "Infinity", "-Infinity", 1.5, None,
    ]  # fmt: skip
    assert json_safe({"a": [math.nan, (math.inf,)], 1: -math.inf}) == {
        "a": ["NaN", ["Infinity"]], "1": "-Infinity",
    }  # fmt: skip


# --------------------------------------------------------------------------- rejections


def a_rank(**overrides) -> RankAnswer:
    base = dict(job="j", rank=1, local_rank=1, world_size=4, pid=10, restart=0, state="alive",
                step=5, phase="train", loss=2.0,
                recent=(Sample(5, "train", 0, 10, 1.0, 0.1, 0.7, 0.2, 2.0, seq=3),),
                recent_from=3)  # fmt: skip
    return RankAnswer(**{**base, **overrides})


def valid_ranks_json() -> dict:
    return over_json(RanksAnswer(node="n", time=1.0, ranks=(a_rank(),), cursor="ab-3").to_json())


@pytest.mark.parametrize(
    "path,value,reason",
    [
        (("ranks", 0, "rank"), "1", "bad_type"),
        (("ranks", 0, "rank"), True, "bad_type"),
        (("ranks", 0, "rank"), 1.0, "bad_type"),
        (("ranks", 0, "rank"), 4, "out_of_range"),  # not below world_size
        (("ranks", 0, "world_size"), 0, "out_of_range"),
        (("ranks", 0, "pid"), -1, "out_of_range"),
        (("ranks", 0, "pid"), 2**63, "out_of_range"),
        (("ranks", 0, "job"), 7, "bad_type"),
        (("ranks", 0, "job"), "j" * 129, "out_of_range"),
        (("ranks", 0, "state"), "dead", "out_of_range"),
        (("ranks", 0, "up"), False, "out_of_range"),  # contradicts "alive"
        (("ranks", 0, "up"), 1, "bad_type"),
        (("ranks", 0, "phase"), "training", "out_of_range"),
        (("ranks", 0, "source"), "guess", "out_of_range"),
        (("ranks", 0, "step_seconds"), "NaN", "bad_type"),  # only a loss may be non-finite
        (("ranks", 0, "step_seconds"), "fast", "bad_type"),
        (("ranks", 0, "loss"), "nan", "bad_type"),  # not the wire spelling
        (("ranks", 0, "loss"), [1.0], "bad_type"),
        (("ranks", 0, "client_errors"), [], "not_object"),
        (("ranks", 0, "client_errors"), {"bad_value": -1}, "out_of_range"),
        (("ranks", 0, "client_errors"), {"bad_value": "1"}, "bad_type"),
        (("ranks", 0, "resume_skips"), {}, "bad_type"),
        (("ranks", 0, "resume_skips"), [[5, 3]], "out_of_range"),
        (("ranks", 0, "resume_skips"), [[1, 4], [5, 6]], "out_of_range"),  # not apart
        (("ranks", 0, "resume_skips"), [[0, 4]], "out_of_range"),
        (("ranks", 0, "resume_skips"), [[1, True]], "bad_type"),
        (("ranks", 0, "resume_skips"), [[1, 2, 3]], "bad_type"),
        (("ranks", 0, "resume_skips"), [[2 * k, 2 * k] for k in range(1, 18)], "out_of_range"),
        (("ranks", 0, "recent"), {}, "bad_type"),
        (("ranks", 0, "recent", 0, "step"), None, "bad_type"),
        (("ranks", 0, "recent", 0, "seq"), "3", "bad_type"),
        (("ranks", 0, "recent_from"), "3", "bad_type"),
        (("ranks", 0), [], "not_object"),
        (("ranks",), {}, "bad_type"),
        (("telemetry", "accepted"), -5, "out_of_range"),
        (("telemetry", "rejected_total"), 99, "out_of_range"),
        (("time",), "now", "bad_type"),
        (("full",), "yes", "bad_type"),
    ],
)
def test_a_malformed_ranks_answer_names_its_field(path, value, reason):
    answer = valid_ranks_json()
    set_at(answer, path, value)
    with pytest.raises(ContractError) as err:
        RanksAnswer.from_json(answer)
    field = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
    assert err.value.reason == reason, str(err.value)
    assert err.value.field.startswith(field) and str(err.value).startswith(err.value.field)


def test_a_ranks_main_thread_is_optional_and_checked():
    """An older agent sends no main thread; a bad one is refused naming its field, on the
    fast path as on the checked one."""
    answer = valid_ranks_json()
    assert RanksAnswer.from_json(answer).ranks[0].main_thread is None
    main = MainThreadAnswer("R", 12.5, 1000.0, 0.98, None, "running")
    answer["ranks"][0]["main_thread"] = main.to_json()
    assert RanksAnswer.from_json(over_json(answer)).ranks[0].main_thread == main
    for key, value, reason in [
        ("state", "RS", "out_of_range"),
        ("state", "1", "out_of_range"),
        ("run_seconds", "12", "bad_type"),
        ("wchan", "w" * 513, "out_of_range"),
        ("syscall", 202, "bad_type"),
    ]:
        bad = over_json(answer)
        bad["ranks"][0]["main_thread"][key] = value
        with pytest.raises(ContractError) as err:
            RanksAnswer.from_json(bad)
        assert err.value.reason == reason and err.value.field == f"ranks[0].main_thread.{key}"


@pytest.mark.parametrize("name", ["state", "recent", "client_errors", "loss", "seq"])
def test_a_missing_field_is_named(name):
    answer = valid_ranks_json()
    holder = answer["ranks"][0]["recent"][0] if name == "seq" else answer["ranks"][0]
    del holder[name]
    with pytest.raises(ContractError) as err:
        RanksAnswer.from_json(answer)
    assert err.value.reason == "missing_field" and err.value.field.endswith(name)


def test_answers_that_are_not_objects():
    for bad in ([1, 2], "ranks", None, 5):
        for model in (RanksAnswer, NodeAnswer):
            with pytest.raises(ContractError) as err:
                model.from_json(bad)
            assert err.value.reason == "not_object"


def test_a_malformed_node_answer_names_its_field():
    good = over_json(NodeAnswer(node="n", version="1", time=1.0, uptime_seconds=2.0,
                                status="healthy",
                                collectors={"gpu": CollectorStatus(True, 0.1)}).to_json())  # fmt: skip
    assert NodeAnswer.from_json(good).collectors["gpu"].success
    for key, value, field in [
        ("status", "fine", "status"),
        ("reasons", [{"code": "x", "severity": "bad", "message": ""}], "reasons[0].severity"),
        ("collectors", {"gpu": {"success": "yes", "duration_seconds": 0, "error": None}},
         "collectors.gpu.success"),
        ("facts", [], "facts"),
        ("warnings", [{"code": 5, "message": ""}], "warnings[0].code"),
        ("warnings", {}, "warnings"),
    ]:  # fmt: skip
        with pytest.raises(ContractError) as err:
            NodeAnswer.from_json({**good, key: value})
        assert err.value.field == field, str(err.value)


@FAST
@given(json_values)
def test_no_json_value_raises_anything_but_a_contract_error(value):
    for model in (RanksAnswer, NodeAnswer):
        assert_only_contract_errors(model, value)


@FAST
@given(st.data())
def test_a_valid_answer_with_one_field_broken_is_refused(data):
    """Any rank field replaced by a value of another JSON type is refused (or, where the
    field may be null and the value is null, taken as it is)."""
    answer = valid_ranks_json()
    name, value = break_one_field(data, answer["ranks"][0])
    try:
        parsed = RanksAnswer.from_json(answer)
    except ContractError as e:
        assert e.field.startswith("ranks[0]")
    else:
        # null, a number for a number, or any text where free text may stand
        assert (
            value is None
            or isinstance(value, (int, float))
            or (name == "state_detail" and isinstance(value, str))
        )
        assert parsed.ranks[0].job == "j"


def _read_both(model, obj, incremental):
    """(from_json's outcome, the checked read's): a result or the error's (reason, field)."""
    out = []
    for read in (model.from_json, model._read):
        try:
            out.append(read(obj, incremental))
        except ContractError as e:
            out.append((e.reason, e.field, str(e)))
    return out


@FAST
@given(st.data(), st.booleans())
def test_the_fast_path_reads_exactly_what_the_checked_read_reads(data, incremental):
    """RankAnswer/Sample.from_json try a fast path first (the supervisor's hot loop,
    docs/scaling.md): on valid ranks, and on ranks with one field (or one sample's field)
    replaced by any JSON value, the outcome (the object, or the error's reason and field)
    equals the field-by-field read's."""
    rank = data.draw(rank_answers(incremental)).to_json(incremental)
    rank = over_json(rank)
    if data.draw(st.booleans()):
        target = rank
        if rank["recent"] and data.draw(st.booleans()):
            target = rank["recent"][0]
        elif "main_thread" in rank and data.draw(st.booleans()):
            target = rank["main_thread"]
        elif rank.get("collectives") and data.draw(st.booleans()):
            target = rank["collectives"][-1]
        name = data.draw(st.sampled_from(sorted(target)))
        target[name] = data.draw(json_values | st.integers(-1, 3) | finite)
    fast, checked = _read_both(RankAnswer, rank, incremental)
    assert repr(fast) == repr(checked)  # repr: a NaN loss equals itself
    for sample in rank["recent"] if isinstance(rank["recent"], list) else ():
        fast, checked = _read_both(Sample, sample, incremental)
        assert repr(fast) == repr(checked)


# --------------------------------------------------------------------------- states


def test_states_one_set_one_meaning():
    assert set(RANK_STATES) == LIVE_STATES | ENDED_STATES
    assert not LIVE_STATES & ENDED_STATES and DEAD_STATES < ENDED_STATES
    # a clean exit is not a death, and not live either
    assert "finished" not in LIVE_STATES and "finished" not in DEAD_STATES
    for state in RANK_STATES:
        assert a_rank(state=state).to_json()["up"] == (state in LIVE_STATES)


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize(
    "module",
    ["rankguard.client", "rankguard.supervisor.daemon", "rankguard.dashboards.build",
     "rankguard.trainer.config"],
)  # fmt: skip
def test_readers_of_the_contract_do_not_import_the_agent(module):
    """The client, the supervisor, the dashboards and the trainer's configuration reach
    the agent only through the contract (and shared daemon code through service/)."""
    import subprocess
    import sys

    probe = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m.startswith(('rankguard.agent', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_an_older_agents_node_answer_without_warnings_reads_as_none():
    answer = NodeAnswer(node="n", version="1", time=1.0, uptime_seconds=2.0, status="healthy",
                        warnings=(NodeWarning("w", "fix it"),))  # fmt: skip
    wire = over_json(answer.to_json())
    assert NodeAnswer.from_json(wire).warnings == (NodeWarning("w", "fix it"),)
    del wire["warnings"]
    assert NodeAnswer.from_json(wire).warnings == ()
