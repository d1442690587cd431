"""Telemetry contract (rankguard.contract.telemetry) and the client's sender (rankguard.client)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager

import pytest
from builders import FAST, json_values
from hypothesis import given
from hypothesis import strategies as st

from rankguard.client import DROP_REASONS, TelemetrySender
from rankguard.contract import telemetry as tm
from rankguard.contract.telemetry import (
    DEFAULT_SOCKET_PATH,
    MAX_DATAGRAM_BYTES,
    PHASES,
    REASONS,
    SCHEMA_VERSION,
    SOCKET_ENV,
    TelemetryError,
    TelemetryRecord,
    decode,
    encode,
    socket_path_from_env,
)

MAX_INT = 2**63


def valid_fields(**overrides):
    fields = dict(
        v=SCHEMA_VERSION,
        job="llama-7b-run-42",
        rank=3,
        local_rank=3,
        world_size=16,
        pid=12345,
        restart=1,
        step=1000,
        phase="train",
        time=1_767_225_600.123456,
        step_seconds=0.75,
        data_wait_seconds=0.01,
        compute_seconds=0.5,
        comm_seconds=0.2,
        comm_exposed_seconds=0.05,
        optimizer_seconds=0.04,
        checkpoint_block_seconds=0.0,
        tokens_per_second=125_000.5,
        mfu=0.42,
        peak_memory_bytes=60 * 2**30,
        loss=2.3456,
        checkpoint_step=900,
    )
    fields.update(overrides)
    return fields


def make(**overrides) -> TelemetryRecord:
    return TelemetryRecord(**valid_fields(**overrides))


def assert_same(a: TelemetryRecord, b: TelemetryRecord) -> None:
    """Field-by-field equality that is exact for floats (NaN == NaN, -0.0 != 0.0)."""
    for f in dataclasses.fields(TelemetryRecord):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert type(x) is type(y), f.name
        if isinstance(x, float):
            assert repr(x) == repr(y), f.name
        else:
            assert x == y, f.name


def reason_of(data: bytes) -> str:
    with pytest.raises(TelemetryError) as info:
        decode(data)
    assert info.value.reason in REASONS
    assert str(info.value)
    return info.value.reason


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- contract


def test_constants():
    assert SCHEMA_VERSION == 1
    assert MAX_DATAGRAM_BYTES == 4096
    assert PHASES == ("init", "train", "checkpoint_save", "checkpoint_load", "eval", "done")
    assert SOCKET_ENV == "RANKGUARD_TELEMETRY_SOCKET"
    assert DEFAULT_SOCKET_PATH == "/run/rankguard/telemetry.sock"
    assert [f.name for f in dataclasses.fields(TelemetryRecord)] == [
        *valid_fields(),
        "client_errors",
        "flops",
        "peak_flops",
        "resume_skips",
        "compute_wait_seconds",
        "gpu_uuid",
        "collectives",
        "progress",
    ]


@pytest.mark.parametrize(
    ("uuid", "ok"),
    [
        ("GPU-6f3c2a1e-8b7d-4c5e-9f0a-1b2c3d4e5f60", True),
        ("MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9", True),
        ("MIG-GPU-6f3c2a1e-8b7d-4c5e-9f0a-1b2c3d4e5f60/1/0", True),  # older drivers' MIG form
        ("GPU-" + "a" * 93, False),  # longer than a label should be
        ("gpu0", False),
        ("GPU-\x1b[2J", False),
        ("", False),
    ],
)
def test_a_gpu_uuid_is_checked_on_the_wire(uuid, ok):
    data = encode(make()).replace(b"}", f',"gpu_uuid":{json.dumps(uuid)}}}'.encode())
    if ok:
        assert decode(data).gpu_uuid == uuid
    else:
        with pytest.raises(TelemetryError) as e:
            decode(data)
        assert e.value.field == "gpu_uuid"


def test_round_trip_full_record():
    rec = make()
    data = encode(rec)
    assert isinstance(data, bytes) and len(data) <= MAX_DATAGRAM_BYTES
    assert b" " not in data.replace(b"llama", b"")  # compact separators
    back = decode(data)
    assert back == rec
    assert_same(back, rec)
    assert back.to_dict() == rec.to_dict()


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_round_trips(loss):
    back = decode(encode(make(loss=loss)))
    assert repr(back.loss) == repr(loss)


def test_resume_skips_are_ranges_ascending_and_apart():
    back = decode(encode(make(resume_skips=[[41, 45], [50, 50]])))
    assert back.resume_skips == ((41, 45), (50, 50))
    assert make(resume_skips=[]).resume_skips is None and make().resume_skips is None
    for bad, reason in (([[5, 3]], "out_of_range"), ([[1, 4], [5, 9]], "out_of_range"),
                        ([[0, 1]], "out_of_range"), ([[1, 1.0]], "bad_type"), ("1-4", "bad_type"),
                        ([[k, k] for k in range(1, 40, 2)], "out_of_range")):  # fmt: skip
        with pytest.raises(TelemetryError) as err:
            make(resume_skips=bad)
        assert (err.value.reason, err.value.field) == (reason, "resume_skips"), bad
    assert tm.skip_ranges([45, 41, 42, 43, 44, 50]) == ((41, 45), (50, 50))
    assert len(tm.skip_ranges(range(1, 100, 2))) == tm.MAX_SKIP_RANGES


def test_none_loss_and_checkpoint_step():
    back = decode(encode(make(loss=None, checkpoint_step=None)))
    assert back.loss is None and back.checkpoint_step is None


def test_every_phase_round_trips():
    for phase in PHASES:
        assert decode(encode(make(phase=phase))).phase == phase


def test_ints_for_floats_are_converted():
    rec = make(loss=3, time=1_700_000_000, step_seconds=1, mfu=1)
    assert type(rec.loss) is float and rec.loss == 3.0
    assert type(rec.time) is float and type(rec.step_seconds) is float
    assert type(rec.mfu) is float
    assert_same(decode(encode(rec)), rec)


def test_comm_compute_ratio():
    assert make(comm_seconds=0.2, compute_seconds=0.5).comm_compute_ratio == pytest.approx(0.4)
    assert make(comm_seconds=0.2, compute_seconds=0.0).comm_compute_ratio == 0.0


def test_unknown_extra_fields_ignored():
    obj = valid_fields()
    obj["future_field"] = {"nested": [1, 2, {"x": None}]}
    obj["another"] = "hello"
    assert_same(decode(dumps(obj)), make())


def test_constructor_validates():
    with pytest.raises(TelemetryError) as info:
        make(step=-1)
    assert info.value.reason == "out_of_range" and info.value.field == "step"
    assert isinstance(info.value, ValueError)
    with pytest.raises(TelemetryError) as info:
        make(rank=True)
    assert info.value.reason == "bad_type" and info.value.field == "rank"


def test_encode_revalidates_corrupted_record():
    rec = make()
    object.__setattr__(rec, "mfu", 7.0)
    with pytest.raises(TelemetryError) as info:
        encode(rec)
    assert info.value.reason == "out_of_range"
    with pytest.raises(TelemetryError):
        rec.validate()


def test_encode_rejects_non_record():
    with pytest.raises(TypeError):
        encode(valid_fields())  # type: ignore[arg-type]


def test_error_pickles():
    err = TelemetryError("bad_type", "rank: expected int, got bool", "rank")
    back = pickle.loads(pickle.dumps(err))
    assert (back.reason, str(back), back.field) == (err.reason, str(err), err.field)
    with pytest.raises(ValueError):
        TelemetryError("made_up", "x")


# ------------------------------------------------------------- one test per refusal


def test_truncated_datagram_is_not_json():
    data = encode(make())
    assert reason_of(data[: len(data) // 2]) == "not_json"
    assert reason_of(b"") == "not_json"


def test_wrong_version():
    assert reason_of(dumps(valid_fields(v=2))) == "wrong_version"
    assert reason_of(dumps(valid_fields(v=0))) == "wrong_version"
    assert reason_of(dumps({"v": 99, "something": "else"})) == "wrong_version"
    assert reason_of(dumps(valid_fields(v="1"))) == "bad_type"


def test_missing_field():
    for name in valid_fields():
        obj = valid_fields()
        del obj[name]
        with pytest.raises(TelemetryError) as info:
            decode(dumps(obj))
        assert info.value.reason == "missing_field"
        assert name in str(info.value) and info.value.field == name


@pytest.mark.parametrize(
    "field,value",
    [
        ("rank", True),
        ("step", False),
        ("world_size", 16.0),
        ("pid", "12345"),
        ("job", 7),
        ("phase", None),
        ("time", "now"),
        ("mfu", True),
        ("loss", "nan"),  # not the wire spelling of NaN
        ("loss", [1.0]),
        ("checkpoint_step", 900.0),
        ("peak_memory_bytes", None),
    ],
)
def test_bad_type(field, value):
    with pytest.raises(TelemetryError) as info:
        decode(dumps(valid_fields(**{field: value})))
    assert info.value.reason == "bad_type"
    assert info.value.field == field and field in str(info.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("step", -1),
        ("rank", 16),
        ("rank", -1),
        ("local_rank", 16),
        ("world_size", 0),
        ("pid", 0),
        ("restart", -1),
        ("checkpoint_step", -5),
        ("step", MAX_INT),
        ("peak_memory_bytes", 10**30),
        ("mfu", 1.0000001),
        ("mfu", -0.1),
        ("step_seconds", -0.001),
        ("comm_seconds", 1e999),
        ("time", -1.0),
        ("tokens_per_second", 1e999),
        ("phase", "training"),
        ("job", ""),
        ("job", "x" * 129),
        ("job", "bad\njob"),
        ("loss", 10**400),
    ],
)
def test_out_of_range(field, value):
    with pytest.raises(TelemetryError) as info:
        decode(dumps(valid_fields(**{field: value})))
    assert info.value.reason == "out_of_range"
    assert info.value.field == field and field in str(info.value)


def test_nan_in_non_loss_field_is_out_of_range():
    text = dumps(valid_fields()).replace(b'"mfu":0.42', b'"mfu":NaN')
    assert reason_of(text) == "out_of_range"
    text = dumps(valid_fields()).replace(b'"step_seconds":0.75', b'"step_seconds":Infinity')
    assert reason_of(text) == "out_of_range"


def test_too_large():
    obj = valid_fields()
    obj["padding"] = "x" * MAX_DATAGRAM_BYTES
    assert reason_of(dumps(obj)) == "too_large"
    assert reason_of(b" " * (MAX_DATAGRAM_BYTES + 1)) == "too_large"
    # Exactly at the limit is still parsed.
    pad = MAX_DATAGRAM_BYTES - len(dumps({**obj, "padding": ""}))
    obj["padding"] = "x" * pad
    assert len(dumps(obj)) == MAX_DATAGRAM_BYTES
    assert_same(decode(dumps(obj)), make())


def test_encode_refuses_oversized(monkeypatch):
    monkeypatch.setattr(tm, "MAX_DATAGRAM_BYTES", 64)
    with pytest.raises(ValueError) as info:
        encode(make())
    assert isinstance(info.value, TelemetryError) and info.value.reason == "too_large"


def test_longest_job_fits():
    # 128 astral-plane characters: the worst case for the encoded size.
    rec = make(job="\U0001f680" * 128)
    assert len(encode(rec)) <= MAX_DATAGRAM_BYTES
    assert_same(decode(encode(rec)), rec)


def test_invalid_utf8():
    assert reason_of(b'{"v":1,"job":"\xff\xfe"}') == "not_utf8"
    assert reason_of(b"\xc3") == "not_utf8"
    # An encoded surrogate (CESU-style) is not valid UTF-8 either.
    assert reason_of(b'{"job":"\xed\xa0\x80"}') == "not_utf8"


def test_not_object():
    assert reason_of(b"[1,2,3]") == "not_object"
    assert reason_of(b'"a string"') == "not_object"
    assert reason_of(b"42") == "not_object"
    assert reason_of(b"null") == "not_object"
    assert reason_of(b"NaN") == "not_object"


def test_deeply_nested_json():
    assert reason_of(b"[" * 4000) == "not_json"
    assert reason_of(b"[" * 2000 + b"]" * 2000) == "not_json"
    assert reason_of(b'{"a":' * 500 + b"1" + b"}" * 500) == "not_json"
    obj = valid_fields()
    obj["x"] = 0
    deep = dumps(obj).replace(b'"x":0', b'"x":' + b"[" * 1000 + b"]" * 1000)
    assert len(deep) <= MAX_DATAGRAM_BYTES
    assert reason_of(deep) == "not_json"
    # Brackets inside strings do not count as nesting.
    assert_same(decode(dumps({**valid_fields(), "s": "[" * 3000})), make())


def test_deep_json_safety_net_without_depth_scan(monkeypatch):
    # Even if the depth pre-scan were bypassed, RecursionError must not escape.
    monkeypatch.setattr(tm, "MAX_JSON_DEPTH", 10**9)
    assert reason_of(b"[" * 4000 + b"]" * 4000) in ("not_json", "too_large")
    assert reason_of(b"[" * 4000) == "not_json"


def test_surrogate_escape_in_job_is_refused():
    text = dumps(valid_fields()).replace(b'"llama-7b-run-42"', b'"\\ud800"')
    assert reason_of(text) == "out_of_range"


def test_memoryview_and_bytearray_accepted():
    data = encode(make())
    assert_same(decode(bytearray(data)), make())
    assert_same(decode(memoryview(data)), make())


# ----------------------------------------------------------------------- properties

printable_chars = st.characters(
    exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")
) | st.just(" ")
nonneg = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False) | st.integers(0, 10**12)


short = st.text("abcxyz019:_-[], ", max_size=12)


def collectives():
    """Process groups' wavefronts (short texts: a record must stay one datagram)."""
    return st.lists(
        st.builds(
            tm.Collective,
            pg=st.text("abc0123:", min_size=1, max_size=8),
            desc=short,
            enqueued=st.integers(-1, MAX_INT - 1),
            completed=st.integers(-1, MAX_INT - 1),
            op=st.none() | short.filter(bool),
            shape=st.none() | short,
            timeout_s=st.none() | st.floats(1e-3, 1e6) | st.integers(1, 10**6),
        ),
        max_size=3,
        unique_by=lambda c: c.pg,
    ).map(tuple)


@st.composite
def records(draw) -> TelemetryRecord:
    world_size = draw(st.integers(1, 64) | st.integers(1, MAX_INT - 1))
    return TelemetryRecord(
        v=SCHEMA_VERSION,
        job=draw(st.text(printable_chars, min_size=1, max_size=128).filter(str.isprintable)),
        rank=draw(st.integers(0, world_size - 1)),
        local_rank=draw(st.integers(0, world_size - 1)),
        world_size=world_size,
        pid=draw(st.integers(1, MAX_INT - 1)),
        restart=draw(st.integers(0, MAX_INT - 1)),
        step=draw(st.integers(0, MAX_INT - 1)),
        phase=draw(st.sampled_from(PHASES)),
        time=draw(nonneg),
        step_seconds=draw(nonneg),
        data_wait_seconds=draw(nonneg),
        compute_seconds=draw(nonneg),
        comm_seconds=draw(nonneg),
        comm_exposed_seconds=draw(nonneg),
        optimizer_seconds=draw(nonneg),
        checkpoint_block_seconds=draw(nonneg),
        tokens_per_second=draw(nonneg),
        mfu=draw(st.floats(0.0, 1.0) | st.integers(0, 1)),
        peak_memory_bytes=draw(st.integers(0, MAX_INT - 1)),
        loss=draw(st.none() | st.floats() | st.integers(-(10**6), 10**6)),
        checkpoint_step=draw(st.none() | st.integers(0, MAX_INT - 1)),
        client_errors=draw(
            st.none()
            | st.dictionaries(
                st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True),
                st.integers(0, MAX_INT - 1),
                max_size=8,
            )  # fmt: skip
        ),
        compute_wait_seconds=draw(st.none() | nonneg),
        collectives=draw(st.none() | collectives()),
        progress=draw(st.booleans()),
    )


def decode_ok_or_telemetry_error(data: bytes) -> None:
    try:
        rec = decode(data)
    except TelemetryError as e:
        assert e.reason in REASONS
        return
    assert isinstance(rec, TelemetryRecord)
    rec.validate()
    assert_same(decode(encode(rec)), rec)


@FAST
@given(records())
def test_property_valid_records_round_trip(rec):
    data = encode(rec)
    assert len(data) <= MAX_DATAGRAM_BYTES
    assert_same(decode(data), rec)


@FAST
@given(st.binary(max_size=MAX_DATAGRAM_BYTES + 16))
def test_property_arbitrary_bytes(data):
    decode_ok_or_telemetry_error(data)


@FAST
@given(json_values)
def test_property_arbitrary_json(value):
    decode_ok_or_telemetry_error(json.dumps(value).encode())


@FAST
@given(
    records(),
    st.dictionaries(st.sampled_from(list(valid_fields())), json_values, max_size=3),
    st.sets(st.sampled_from(list(valid_fields())), max_size=2),
    st.dictionaries(st.text(max_size=8), json_values, max_size=2),
)
def test_property_mutated_records(rec, replace, remove, extra):
    obj = {**extra, **rec.to_dict(), **replace}
    for name in remove:
        obj.pop(name, None)
    decode_ok_or_telemetry_error(json.dumps(obj).encode())


@FAST
@given(records(), st.data())
def test_property_truncations_and_bit_flips(rec, data):
    raw = bytearray(encode(rec))
    cut = data.draw(st.integers(0, len(raw)))
    decode_ok_or_telemetry_error(bytes(raw[:cut]))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    decode_ok_or_telemetry_error(bytes(raw))


# ------------------------------------------------------------------------ env path


def test_socket_path_from_env():
    assert socket_path_from_env({}) == DEFAULT_SOCKET_PATH
    assert socket_path_from_env({SOCKET_ENV: ""}) is None
    assert socket_path_from_env({SOCKET_ENV: "off"}) is None
    assert socket_path_from_env({SOCKET_ENV: " OFF "}) is None
    assert socket_path_from_env({SOCKET_ENV: "/tmp/x.sock"}) == "/tmp/x.sock"
    assert socket_path_from_env({"OTHER": "off"}) == DEFAULT_SOCKET_PATH


def test_socket_path_from_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv(SOCKET_ENV, "/tmp/from-env.sock")
    assert socket_path_from_env() == "/tmp/from-env.sock"
    monkeypatch.setenv(SOCKET_ENV, "off")
    assert socket_path_from_env() is None
    monkeypatch.delenv(SOCKET_ENV)
    assert socket_path_from_env() == DEFAULT_SOCKET_PATH


# -------------------------------------------------------------------------- sender


@pytest.fixture
def sock_dir(tmp_path):
    """A directory whose socket paths fit AF_UNIX's 108-byte limit."""
    if len(str(tmp_path)) < 80:
        yield tmp_path
        return
    d = tempfile.mkdtemp(prefix="rgtm")
    try:
        from pathlib import Path

        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bind_receiver(path) -> socket.socket:
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(path))
    rx.settimeout(5.0)
    return rx


def receive(rx: socket.socket) -> TelemetryRecord:
    return decode(rx.recv(MAX_DATAGRAM_BYTES + 1))


@contextmanager
def sender_and_receiver(path):
    """A sender aimed at a bound receiver at ``path``; both closed afterwards."""
    rx = bind_receiver(path)
    sender = TelemetrySender(str(path))
    try:
        yield sender, rx
    finally:
        sender.close()
        rx.close()


def test_sender_real_receiver(sock_dir):
    with sender_and_receiver(sock_dir / "t.sock") as (sender, rx):
        sent = []
        for i in range(8):  # below the kernel's default datagram queue length (10)
            rec = make(step=i, loss=math.nan if i == 3 else float(i), phase=PHASES[i % 6])
            assert sender.send(rec) is True
            sent.append(rec)
        got = [receive(rx) for _ in sent]
        for a, b in zip(got, sent, strict=True):
            assert_same(a, b)
        assert (sender.sent, sender.dropped, sender.dropped_by_reason) == (8, 0, {})
        # A mapping is accepted too.
        assert sender.send(valid_fields(step=99)) is True
        assert receive(rx).step == 99


def test_sender_many_records_with_draining_receiver(sock_dir):
    with sender_and_receiver(sock_dir / "t.sock") as (sender, rx):
        received = []
        for i in range(200):
            assert sender.send(make(step=i)) is True
            received.append(receive(rx))
        assert [r.step for r in received] == list(range(200))
        assert sender.sent == 200 and sender.dropped == 0


def test_sender_no_receiver_is_fast_and_silent(sock_dir):
    sender = TelemetrySender(str(sock_dir / "missing" / "nobody.sock"))
    rec = make()
    start = time.monotonic()
    for _ in range(10_000):
        assert sender.send(rec) is False
    assert time.monotonic() - start < 5.0
    assert sender.sent == 0 and sender.dropped == 10_000
    assert sender.dropped_by_reason == {"no_socket": 10_000}
    sender.close()


def test_sender_full_queue_never_blocks(sock_dir):
    with sender_and_receiver(sock_dir / "full.sock") as (sender, rx):
        rec = make()  # the receiver reads nothing until the end
        start = time.monotonic()
        results = [sender.send(rec) for _ in range(2000)]
        assert time.monotonic() - start < 5.0
        assert results[0] is True
        assert sender.dropped_by_reason.get("queue_full", 0) > 0
        assert sender.sent + sender.dropped == 2000
        assert sender.sent == results.count(True) and sender.dropped == results.count(False)
        # Once the receiver drains, sending works again.
        rx.setblocking(False)
        drained = 0
        while True:
            try:
                receive(rx)
                drained += 1
            except BlockingIOError:
                break
        assert drained == sender.sent
        assert sender.send(rec) is True


def test_sender_receiver_goes_away_and_comes_back(sock_dir):
    path = sock_dir / "gone.sock"
    rx = bind_receiver(path)
    sender = TelemetrySender(str(path))
    try:
        assert sender.send(make(step=1)) is True
        assert receive(rx).step == 1
        rx.close()  # socket closed, stale file left behind
        assert sender.send(make(step=2)) is False
        assert sender.dropped_by_reason == {"refused": 1}
        os.unlink(path)  # and now the file is gone too
        assert sender.send(make(step=3)) is False
        assert sender.dropped_by_reason == {"refused": 1, "no_socket": 1}
        rx = bind_receiver(path)  # agent restarted: no reconnect needed
        assert sender.send(make(step=4)) is True
        assert receive(rx).step == 4
        assert (sender.sent, sender.dropped) == (2, 2)
    finally:
        sender.close()
        rx.close()


def test_sender_disabled():
    sender = TelemetrySender(None)
    assert not sender.enabled
    for _ in range(5):
        assert sender.send(make()) is False
    assert sender.dropped == 5 and sender.dropped_by_reason == {"disabled": 5}
    assert sender.sent == 0
    sender.close()


def test_sender_invalid_records_are_dropped(sock_dir):
    with sender_and_receiver(sock_dir / "inv.sock") as (sender, rx):
        assert sender.send(valid_fields(step=-1)) is False  # mapping that fails validation
        assert sender.send({"v": 1}) is False  # missing fields
        bad = make()
        object.__setattr__(bad, "loss", "nan")
        assert sender.send(bad) is False  # corrupted record
        assert sender.send(object()) is False  # type: ignore[arg-type]
        assert sender.dropped_by_reason == {"invalid": 4}
        assert sender.send(make()) is True


def test_sender_odd_paths_do_not_raise(sock_dir):
    for path in ["bad\0path", "/" + "x" * 200, str(sock_dir)]:
        sender = TelemetrySender(path)
        assert sender.send(make()) is False
        assert sender.dropped == 1
        assert set(sender.dropped_by_reason) <= set(DROP_REASONS)
        sender.close()


def test_sender_close_is_idempotent_and_drops_after(sock_dir):
    path = sock_dir / "c.sock"
    rx = bind_receiver(path)
    try:
        with TelemetrySender(str(path)) as sender:
            assert sender.send(make()) is True
        sender.close()
        assert sender.send(make()) is False
        assert sender.dropped_by_reason == {"closed": 1}
        assert "sent=1" in repr(sender)
    finally:
        rx.close()


def test_fast_path_takes_the_clients_error_counters():
    """A rank that dropped a record once sends its counters ever after: still fast."""
    obj = {**valid_fields(), "client_errors": {"queue_full": 3, "no_socket": 0}}
    fast = tm.fast_record(json.loads(json.dumps(obj)))
    assert fast is not None and fast.client_errors == {"queue_full": 3, "no_socket": 0}
    assert_same(fast, TelemetryRecord.from_dict(obj))
    for bad in ({"queue full": 1}, {"queue_full": -1}, {"queue_full": True}, [1]):
        assert tm.fast_record({**obj, "client_errors": bad}) is None  # the full path says why


@FAST
@given(
    records(),
    st.dictionaries(
        st.sampled_from(
            [
                *valid_fields(),
                "flops",
                "peak_flops",
                "client_errors",
                "resume_skips",
                "compute_wait_seconds",
                "collectives",
                "progress",
            ]
        ),  # fmt: skip
        json_values
        | st.sampled_from(
            [
                -0.0,
                1.0,
                2**63,
                2**64,
                True,
                "NaN",
                1e308,
                {},
                {"queue_full": 2},
                {"queue_full": 2**63},
                {"Queue-Full": 1},
                [[3, 5]],
                [[5, 3]],
                False,
                [],
                [
                    {
                        "pg": "0",
                        "desc": "",
                        "enqueued": 2,
                        "completed": 1,
                        "op": None,
                        "shape": None,
                        "timeout_s": 60,
                    }
                ],
                [
                    {
                        "pg": "0",
                        "desc": "",
                        "enqueued": -2,
                        "completed": 1,
                        "op": None,
                        "shape": None,
                        "timeout_s": None,
                    }
                ],
            ]
        ),  # fmt: skip
        max_size=3,
    ),
)
def test_property_fast_path_accepts_only_what_the_full_check_does(rec, replace):
    """decode's fast path (the common record, no field-by-field checks) and the agent's
    orjson parser: the same record or the same refusal as json.loads + from_dict."""
    from rankguard.agent.receiver import decode_record

    obj = {**rec.to_dict(), **replace}
    if isinstance(obj.get("loss"), float) and not math.isfinite(obj["loss"]):
        obj["loss"] = tm.encode_float(obj["loss"])
    data = json.dumps(obj).encode()
    try:
        full = TelemetryRecord.from_dict(json.loads(data))
    except TelemetryError as e:
        full = e.reason
    fast = tm.fast_record(json.loads(data))
    if fast is not None:
        assert not isinstance(full, str), full
        assert_same(fast, full)
    try:
        agent = decode_record(data)
    except TelemetryError as e:
        agent = e.reason
    if isinstance(full, str):
        assert agent == full
    else:
        assert_same(agent, full)
