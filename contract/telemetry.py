"""Telemetry contract between the trainer (sender) and the node agent (receiver).

One :class:`TelemetryRecord` per step per rank travels as one compact JSON datagram
over a Unix datagram socket. This module is the single definition of the schema and
is stdlib-only: the agent imports it and must never pull in torch.

Validation happens at construction time: ``TelemetryRecord(...)`` raises
:class:`TelemetryError` for any field that breaks the rules below, so the trainer can
never build an invalid record silently. :func:`encode` validates again (a record can
still be corrupted with ``object.__setattr__``) and :func:`decode` turns any bytes into
either a valid record or a :class:`TelemetryError` whose ``reason`` is a short,
bounded code fit for a Prometheus label.

Rules:

* integers are real ``int`` (never ``bool`` or ``float``), ``0 <= x < 2**63``;
  ``world_size >= 1``, ``rank`` and ``local_rank`` below ``world_size``, ``pid >= 1``,
  ``checkpoint_step`` is ``None`` or a step;
* ``phase`` is one of :data:`PHASES`; ``job`` is 1..128 printable characters;
* ``time``, every ``*_seconds`` and ``tokens_per_second`` are finite and ``>= 0``
  (ints are accepted and stored as ``float``); ``mfu`` is finite in ``[0, 1]``;
* ``loss`` is ``None`` or any float, NaN and +-Inf included (a diverged loss is exactly
  what the supervisor needs to see); ints are accepted and stored as ``float``; on the
  wire a non-finite loss is a string (``contract/numbers.py``), as everywhere else;
* ``client_errors`` (optional) is the client library's own failure counters: at most
  :data:`MAX_CLIENT_ERRORS` entries, each a reason (``[a-z][a-z0-9_]*``, at most
  :data:`MAX_REASON_CHARS` characters) and a count; the agent shows them per rank;
* ``flops`` (optional) is the model FLOPs the step did and ``peak_flops`` (optional) the
  rank's peak FLOP/s, finite and ``>= 0``: the agent counts FLOPs done
  (``rankguard_rank_flops_total``), so MFU over any window is a ``rate()`` over the peak;
* ``compute_wait_seconds`` (optional) is the part of ``compute_seconds`` the rank's loop
  thread spent runnable but waiting for a CPU (Linux schedstat's run-queue wait), finite
  and ``>= 0``; absent means unknown (an older client, not Linux): the supervisor's
  straggler detector tells a preempted rank from a slow one by it;
* ``gpu_uuid`` (optional) is the GPU the rank computes on, as NVML names it
  (``GPU-<uuid>``, or ``MIG-<uuid>`` for a MIG instance; at most
  :data:`MAX_GPU_UUID_CHARS` characters of letters, digits, ``-`` and ``/``): the agent ties
  the rank to that GPU's faults by it;
* ``resume_skips`` (optional) is the data steps the rank's resume skipped (a loss spike's
  window, issue 20), as at most :data:`MAX_SKIP_RANGES` ``[first, last]`` ranges of whole
  numbers ``>= 1``, ascending and apart; the supervisor puts them in the incident that
  restarted the job;
* ``collectives`` (optional) is the rank's flight-recorder wavefront: at most
  :data:`MAX_COLLECTIVES` :class:`Collective` objects, one per process group (distinct
  ``pg``), each ``{"pg", "desc", "enqueued", "completed", "op", "shape", "timeout_s"}``:
  ``pg`` the group's name (1..64 printable characters), ``desc`` its description (0..64
  printable), ``enqueued`` and ``completed`` the last collective sequence ids the rank
  enqueued and saw complete in it (whole numbers ``>= -1``), ``op`` the enqueued one's
  name (``None`` or 1..48 printable), ``shape`` its input sizes as compact JSON (``None``
  or 0..64 printable) and ``timeout_s`` the group's timeout (``None`` or finite ``> 0``;
  an int is stored as ``float``). The supervisor finds a hang's culprit by them;
* ``progress`` (optional, default true) is a ``bool``: a record with ``progress`` false is
  evidence, not progress (the Reporter's wavefront while the rank stalls): the agent keeps
  its ``collectives`` and when they came, and nothing else (not a heartbeat, not a step).
  From a zero-code worker (client/collective_watch.py) it may carry ``collectives`` null
  and a ``step`` over 0: the script's optimizer step, a beacon the agent keeps as the
  worker's ``script_step`` (what an incident names), nothing else.

Unknown extra fields in a datagram are ignored (forward compatible within a schema
version); a different ``v`` is refused with reason ``wrong_version``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import REASONS, ContractError
from .numbers import decode_float, encode_float

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "NO_STEP",
    "MAX_CLIENT_ERRORS",
    "MAX_COLLECTIVES",
    "MAX_DATAGRAM_BYTES",
    "MAX_JOB_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_SKIP_RANGES",
    "PHASES",
    "REASONS",
    "SCHEMA_VERSION",
    "STALL_WATCH_THREAD",
    "SOCKET_ENV",
    "SPLIT_FIELDS",
    "Collective",
    "TelemetryError",
    "TelemetryRecord",
    "check_collectives",
    "check_skip_ranges",
    "comm_compute_ratio",
    "decode",
    "encode",
    "fast_record",
    "is_gpu_uuid",
    "is_reason_name",
    "skip_ranges",
    "socket_path_from_env",
]

SCHEMA_VERSION = 1
MAX_DATAGRAM_BYTES = 4096
PHASES = ("init", "train", "checkpoint_save", "checkpoint_load", "eval", "done")
SOCKET_ENV = "RANKGUARD_TELEMETRY_SOCKET"
# The fields of a record that reports no step, only who sends it: a worker found in /proc,
# a trainer's start-up announcement, a zero-code worker's wavefront.
NO_STEP: Mapping[str, Any] = MappingProxyType(dict(
    step=0, step_seconds=0.0, data_wait_seconds=0.0, compute_seconds=0.0, comm_seconds=0.0,
    comm_exposed_seconds=0.0, optimizer_seconds=0.0, checkpoint_block_seconds=0.0,
    tokens_per_second=0.0, mfu=0.0, peak_memory_bytes=0, loss=None, checkpoint_step=None,
))  # fmt: skip
DEFAULT_SOCKET_PATH = "/run/rankguard/telemetry.sock"
# The Reporter's stall watch thread, which sends a stalled rank's flight-recorder
# wavefront: the zero-code watch steps aside for it, the supervisor finds it in stacks.
STALL_WATCH_THREAD = "rankguard-wavefront"

MAX_JOB_CHARS = 128
#: Deepest JSON nesting decode will parse; a valid record has depth 1.
MAX_JSON_DEPTH = 32
#: Exclusive upper bound of every integer field (fits an int64).
MAX_INT = 2**63

#: The client's failure counters a record may carry, and how long a reason may be.
MAX_CLIENT_ERRORS = 32
MAX_REASON_CHARS = 48
_REASON_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: Ranges of skipped data steps a record may carry (one spike gives one range).
MAX_SKIP_RANGES = 16
#: A GPU's NVML UUID: GPU-<uuid>, MIG-<uuid>, or the older MIG-GPU-<uuid>/<gi>/<ci>.
MAX_GPU_UUID_CHARS = 96
_GPU_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*")
#: Process groups a record's wavefront may name, and how long its texts may be.
MAX_COLLECTIVES = 16
MAX_PG_CHARS = 64
MAX_OP_CHARS = 48
MAX_SHAPE_CHARS = 64


def is_gpu_uuid(value: Any) -> bool:
    """Whether ``value`` reads as an NVML GPU or MIG UUID (bounded, label-safe)."""
    return (
        isinstance(value, str)
        and len(value) <= MAX_GPU_UUID_CHARS
        and bool(_GPU_UUID.fullmatch(value))
    )


def job_file(socket_path: str | os.PathLike, folder: str, job: str) -> Path:
    """A job's file in ``folder`` beside the telemetry socket (the agent writes it, the
    job's processes read it), named by the job's digest: a job's name may hold any
    character."""
    digest = hashlib.sha256(job.encode()).hexdigest()[:32]
    return Path(socket_path).parent / folder / f"{digest}.json"


def read_job_file(data: bytes, limit: int, what: str) -> Any:
    """The JSON value of a job file's bytes (at most ``limit`` of them), or ContractError."""
    if len(data) > limit:
        raise ContractError("too_large", f"{what} is at most {limit} bytes")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise ContractError("not_json", f"{what} is JSON") from None


def socket_path_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """Telemetry socket path from ``RANKGUARD_TELEMETRY_SOCKET``.

    Unset -> :data:`DEFAULT_SOCKET_PATH`; set to ``""`` or ``"off"`` (any case,
    surrounding blanks ignored) -> ``None`` (telemetry disabled); else the value.
    """
    value = environ.get(SOCKET_ENV)
    if value is None:
        return DEFAULT_SOCKET_PATH
    if value.strip().lower() in ("", "off"):
        return None
    return value


class TelemetryError(ContractError):
    """A record or datagram that breaks the telemetry contract.

    ``reason`` is one of :data:`REASONS` (``contract/errors.py``); ``field`` names the
    offending field when there is one; the message says which field and why.
    """


_INT_FIELDS = (
    "v",
    "rank",
    "local_rank",
    "world_size",
    "pid",
    "restart",
    "step",
    "peak_memory_bytes",
)


#: The parts of a step's wall time, as the record names them.
SPLIT_FIELDS = (
    "data_wait_seconds",
    "compute_seconds",
    "comm_seconds",
    "comm_exposed_seconds",
    "optimizer_seconds",
    "checkpoint_block_seconds",
)


_NONNEG_FLOAT_FIELDS = ("time", "step_seconds", *SPLIT_FIELDS, "tokens_per_second")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bad_type(name: str, expected: str, value: Any) -> TelemetryError:
    return TelemetryError(
        "bad_type", f"{name}: expected {expected}, got {type(value).__name__}", name
    )


def _version_message(v: int) -> str:
    shown = v if -MAX_INT < v < MAX_INT else "a huge number"
    return f"v: schema version {shown}, expected {SCHEMA_VERSION}"


def _out_of_range(name: str, why: str) -> TelemetryError:
    return TelemetryError("out_of_range", f"{name}: {why}", name)


def _check_int(name: str, value: Any, minimum: int = 0) -> int:
    if not _is_int(value):
        raise _bad_type(name, "int", value)
    if not minimum <= value < MAX_INT:
        shown = (
            value if -MAX_INT < value < MAX_INT else ("a huge negative" if value < 0 else "a huge")
        )
        raise _out_of_range(name, f"{shown} not in [{minimum}, 2**63)")
    return int(value)


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad_type(name, "number", value)
    try:
        return float(value)
    except OverflowError:
        raise _out_of_range(name, "integer too large for a float") from None


def is_reason_name(name: Any) -> bool:
    """Whether ``name`` may key ``client_errors`` (a bounded, label-safe name)."""
    return (
        isinstance(name, str)
        and len(name) <= MAX_REASON_CHARS
        and bool(_REASON_NAME.fullmatch(name))
    )


def _loss(value: Any) -> float:
    """Any float, a non-finite one given as a number or in its wire spelling."""
    try:
        return decode_float(value, "loss", finite=False)
    except ContractError as e:
        raise TelemetryError(e.reason, str(e), "loss") from None


def _check_client_errors(value: Any) -> dict[str, int] | None:
    """The client's counters, copied; None when there are none."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad_type("client_errors", "object", value)
    if len(value) > MAX_CLIENT_ERRORS:
        raise _out_of_range("client_errors", f"{len(value)} entries > {MAX_CLIENT_ERRORS}")
    out: dict[str, int] = {}
    for reason, count in value.items():
        if not is_reason_name(reason):
            raise _out_of_range("client_errors", f"{str(reason)[:40]!r} is not a reason name")
        out[reason] = _check_int(f"client_errors.{reason}", count)
    return out or None


def check_skip_ranges(name: str, value: Any) -> tuple[tuple[int, int], ...]:
    """``[[first, last], ...]`` ranges of data steps: at most MAX_SKIP_RANGES, whole
    numbers >= 1, each first <= last, ascending and apart. Raises ContractError."""
    if not isinstance(value, (list, tuple)):
        raise _bad_type(name, "array", value)
    if len(value) > MAX_SKIP_RANGES:
        raise _out_of_range(name, f"{len(value)} ranges > {MAX_SKIP_RANGES}")
    out: list[tuple[int, int]] = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _bad_type(name, "[first, last] pairs", pair)
        first, last = (_check_int(name, x, 1) for x in pair)
        if first > last or (out and first <= out[-1][1] + 1):
            raise _out_of_range(name, "ranges must be ascending, apart, first <= last")
        out.append((first, last))
    return tuple(out)


def skip_ranges(steps: Any) -> tuple[tuple[int, int], ...]:
    """Whole numbers >= 1 as ``(first, last)`` ranges, the first MAX_SKIP_RANGES of them."""
    out: list[list[int]] = []
    for d in sorted(set(steps)):
        if out and d == out[-1][1] + 1:
            out[-1][1] = d
        else:
            out.append([d, d])
    return tuple((a, b) for a, b in out[:MAX_SKIP_RANGES])


def _check_nonneg_float(name: str, value: Any) -> float:
    f = _to_float(name, value)
    if not (math.isfinite(f) and f >= 0.0):
        raise _out_of_range(name, f"{f!r} is not a finite number >= 0")
    return f


def comm_compute_ratio(comm_seconds: float, compute_seconds: float) -> float:
    """comm / compute; 0.0 when compute is 0. Not bounded by 1: communication can take
    longer than compute."""
    return comm_seconds / compute_seconds if compute_seconds > 0 else 0.0


def _check_text(name: str, value: Any, low: int, high: int) -> str:
    if not isinstance(value, str):
        raise _bad_type(name, "str", value)
    if not low <= len(value) <= high:
        raise _out_of_range(name, f"length {len(value)} not in [{low}, {high}]")
    if not value.isprintable():
        raise _out_of_range(name, "contains non-printable characters")
    return value


#: A Collective's fields, in wire order (every one present on the wire, ``null`` if none).
COLLECTIVE_FIELDS = ("pg", "desc", "enqueued", "completed", "op", "shape", "timeout_s")


@dataclass(frozen=True)
class Collective:
    """One process group's place in its sequence of collectives, as a rank's flight
    recorder shows it (``client/flight_recorder.py``): ``enqueued`` and ``completed`` are
    the last sequence ids the rank enqueued and saw complete in group ``pg`` (-1: none
    yet); ``op``, ``shape`` and ``timeout_s`` describe the enqueued one when the recorder
    still holds it. Validated on construction (:class:`TelemetryError`, field named)."""

    pg: str
    desc: str
    enqueued: int
    completed: int
    op: str | None = None
    shape: str | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        _check_text("pg", self.pg, 1, MAX_PG_CHARS)
        _check_text("desc", self.desc, 0, MAX_PG_CHARS)
        for name in ("enqueued", "completed"):
            value = getattr(self, name)
            if not _is_int(value):
                raise _bad_type(name, "int", value)
            if not -1 <= value < MAX_INT:
                raise _out_of_range(name, "not in [-1, 2**63)")
        if self.op is not None:
            _check_text("op", self.op, 1, MAX_OP_CHARS)
        if self.shape is not None:
            _check_text("shape", self.shape, 0, MAX_SHAPE_CHARS)
        if self.timeout_s is not None:
            t = _to_float("timeout_s", self.timeout_s)
            if not (math.isfinite(t) and t > 0.0):
                raise _out_of_range("timeout_s", f"{t!r} is not a finite number > 0")
            object.__setattr__(self, "timeout_s", t)

    def to_json(self) -> dict[str, Any]:
        return {"pg": self.pg, "desc": self.desc, "enqueued": self.enqueued,
                "completed": self.completed, "op": self.op, "shape": self.shape,
                "timeout_s": self.timeout_s}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> Collective:
        """From its wire object (every field present; unknown ones ignored). Raises
        :class:`TelemetryError` naming the field."""
        if not isinstance(obj, Mapping):
            raise TelemetryError("not_object", f"expected an object, got {type(obj).__name__}")
        missing = [name for name in COLLECTIVE_FIELDS if name not in obj]
        if missing:
            raise TelemetryError("missing_field", f"{missing[0]}: missing", missing[0])
        return cls(*(obj[name] for name in COLLECTIVE_FIELDS))


def check_collectives(value: Any) -> tuple[Collective, ...] | None:
    """A record's wavefront: Collective objects or their wire objects, at most
    MAX_COLLECTIVES, distinct groups; None when there are none."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise _bad_type("collectives", "array", value)
    if len(value) > MAX_COLLECTIVES:
        raise _out_of_range("collectives", f"{len(value)} groups > {MAX_COLLECTIVES}")
    out: list[Collective] = []
    for i, item in enumerate(value):
        try:
            # an instance is checked again too: it can be altered after its construction
            wire = item.to_json() if isinstance(item, Collective) else item
            out.append(Collective.from_json(wire))
        except ContractError as e:
            raise e.within(f"collectives[{i}]") from None
    if len({c.pg for c in out}) != len(out):
        raise _out_of_range("collectives", "a process group is named twice")
    return tuple(out) or None


@dataclass(frozen=True)
class TelemetryRecord:
    """One step of one rank, as the trainer reports it. Validated on construction.

    Raises :class:`TelemetryError` (a ``ValueError``) from the constructor when any
    field breaks the contract (see the module docstring). Numeric float fields given
    as ``int`` are stored as ``float``.
    """

    v: int
    job: str
    rank: int
    local_rank: int
    world_size: int
    pid: int
    restart: int
    step: int
    phase: str
    time: float
    step_seconds: float
    data_wait_seconds: float
    compute_seconds: float
    comm_seconds: float
    comm_exposed_seconds: float
    optimizer_seconds: float
    checkpoint_block_seconds: float
    tokens_per_second: float
    mfu: float
    peak_memory_bytes: int
    loss: float | None
    checkpoint_step: int | None
    client_errors: Mapping[str, int] | None = None
    flops: float | None = None
    peak_flops: float | None = None
    resume_skips: tuple[tuple[int, int], ...] | None = None
    compute_wait_seconds: float | None = None
    gpu_uuid: str | None = None
    collectives: tuple[Collective, ...] | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name, value in self._normalized().items():
            object.__setattr__(self, name, value)

    def validate(self) -> None:
        """Raise :class:`TelemetryError` unless every field follows the contract."""
        self._normalized()

    def _normalized(self) -> dict[str, Any]:
        """Check every field; return the values to store (ints, floats normalized)."""
        out: dict[str, Any] = {}
        v = self.v
        if not _is_int(v):
            raise _bad_type("v", "int", v)
        if v != SCHEMA_VERSION:
            raise TelemetryError("wrong_version", _version_message(v), "v")
        for name in _INT_FIELDS:
            minimum = 1 if name in ("world_size", "pid") else 0
            out[name] = _check_int(name, getattr(self, name), minimum)
        world_size = out["world_size"]
        for name in ("rank", "local_rank"):
            if out[name] >= world_size:
                raise _out_of_range(name, f"{out[name]} >= world_size {world_size}")

        job = self.job
        if not isinstance(job, str):
            raise _bad_type("job", "str", job)
        if not 1 <= len(job) <= MAX_JOB_CHARS:
            raise _out_of_range("job", f"length {len(job)} not in [1, {MAX_JOB_CHARS}]")
        if not job.isprintable():
            raise _out_of_range("job", "contains non-printable characters")

        phase = self.phase
        if not isinstance(phase, str):
            raise _bad_type("phase", "str", phase)
        if phase not in PHASES:
            raise _out_of_range("phase", f"{phase[:32]!r} is not one of {', '.join(PHASES)}")

        for name in _NONNEG_FLOAT_FIELDS:
            out[name] = _check_nonneg_float(name, getattr(self, name))
        mfu = _to_float("mfu", self.mfu)
        if not (math.isfinite(mfu) and 0.0 <= mfu <= 1.0):
            raise _out_of_range("mfu", f"{mfu!r} is not in [0, 1]")
        out["mfu"] = mfu

        loss = self.loss
        out["loss"] = None if loss is None else _loss(loss)
        cs = self.checkpoint_step
        out["checkpoint_step"] = None if cs is None else _check_int("checkpoint_step", cs)
        out["client_errors"] = _check_client_errors(self.client_errors)
        for name in OPTIONAL_FLOAT_FIELDS:
            value = getattr(self, name)
            out[name] = None if value is None else _check_nonneg_float(name, value)
        skips = self.resume_skips
        out["resume_skips"] = (
            None if skips is None else check_skip_ranges("resume_skips", skips) or None
        )
        uuid = self.gpu_uuid
        if uuid is not None and not is_gpu_uuid(uuid):
            if not isinstance(uuid, str):
                raise _bad_type("gpu_uuid", "str", uuid)
            raise _out_of_range("gpu_uuid", f"{uuid[:40]!r} is not a GPU or MIG UUID")
        out["collectives"] = check_collectives(self.collectives)
        if not isinstance(self.progress, bool):
            raise _bad_type("progress", "bool", self.progress)
        return out

    @property
    def comm_compute_ratio(self) -> float:
        return comm_compute_ratio(self.comm_seconds, self.compute_seconds)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields, in schema order (the optional ones only when set)."""
        out = {name: getattr(self, name) for name in REQUIRED_FIELDS}
        for name in OPTIONAL_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.collectives:  # plain JSON objects, as on the wire
            out["collectives"] = [c.to_json() for c in self.collectives]
        if self.progress is False:  # the default (progress) is left out
            out["progress"] = False
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> TelemetryRecord:
        """Build a record from a mapping; unknown keys are ignored.

        Raises :class:`TelemetryError` (``wrong_version``, ``missing_field``,
        ``bad_type`` or ``out_of_range``).
        """
        if "v" in obj:
            v = obj["v"]
            if not _is_int(v):
                raise _bad_type("v", "int", v)
            if v != SCHEMA_VERSION:
                raise TelemetryError("wrong_version", _version_message(v), "v")
        missing = [name for name in REQUIRED_FIELDS if name not in obj]
        if missing:
            raise TelemetryError(
                "missing_field", f"missing field(s): {', '.join(missing)}", missing[0]
            )
        return cls(
            **{name: obj[name] for name in REQUIRED_FIELDS},
            **{name: obj.get(name) for name in OPTIONAL_FIELDS},
            progress=obj.get("progress", True),
        )


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TelemetryRecord))
#: Fields a record may leave out (added within schema version 1).
OPTIONAL_FLOAT_FIELDS: tuple[str, ...] = ("flops", "peak_flops", "compute_wait_seconds")
OPTIONAL_FIELDS: tuple[str, ...] = (
    "client_errors",
    *OPTIONAL_FLOAT_FIELDS,
    "resume_skips",
    "gpu_uuid",
    "collectives",
)
#: Every field but the optional ones (and ``progress``, whose default is true).
REQUIRED_FIELDS: tuple[str, ...] = tuple(
    n for n in FIELD_NAMES if n not in OPTIONAL_FIELDS and n != "progress"
)


def encode(record: TelemetryRecord, *, validate: bool = True) -> bytes:
    """Compact UTF-8 JSON for one record (a non-finite loss in its wire spelling).

    Raises :class:`TelemetryError` if the record is invalid, ``too_large`` if the
    datagram would exceed :data:`MAX_DATAGRAM_BYTES`, and ``TypeError`` if ``record``
    is not a :class:`TelemetryRecord`. ``validate=False`` skips the second check, for a
    record the caller has just constructed (the constructor validated it): the sender's
    hot path.
    """
    if not isinstance(record, TelemetryRecord):
        raise TypeError(f"expected TelemetryRecord, got {type(record).__name__}")
    if validate:
        record.validate()
    fields = record.to_dict()
    fields["loss"] = encode_float(fields["loss"])
    data = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode("ascii")
    if len(data) > MAX_DATAGRAM_BYTES:
        raise TelemetryError(
            "too_large", f"encoded record is {len(data)} bytes > {MAX_DATAGRAM_BYTES}"
        )
    return data


def _json_depth(text: str) -> int:
    """Maximum bracket nesting of a JSON text, ignoring brackets inside strings."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif ch in "]}":
            depth -= 1
    return deepest


_FAST_FLOATS = (*_NONNEG_FLOAT_FIELDS, "mfu")


def fast_record(obj: dict) -> TelemetryRecord | None:
    """The common record (exact types, every value in range) built without the
    field-by-field checks, which cost more than parsing the JSON; None for anything else,
    which then goes through :meth:`TelemetryRecord.from_dict` and its named errors. It
    accepts only what ``from_dict`` accepts, with equal values (a property test)."""
    try:
        if obj["v"] != SCHEMA_VERSION or type(obj["v"]) is not int:
            return None
        values = {}
        for name in _INT_FIELDS:
            x = obj[name]
            if type(x) is not int or not 0 <= x < MAX_INT:
                return None
            values[name] = x
        if values["world_size"] < 1 or values["pid"] < 1:
            return None
        if values["rank"] >= values["world_size"] or values["local_rank"] >= values["world_size"]:
            return None
        for name in _FAST_FLOATS:
            x = obj[name]
            if type(x) is not float or not 0.0 <= x < math.inf:
                return None
            values[name] = x
        if values["mfu"] > 1.0:
            return None
        job, phase, loss, cs = obj["job"], obj["phase"], obj["loss"], obj["checkpoint_step"]
        if type(job) is not str or not 1 <= len(job) <= MAX_JOB_CHARS or not job.isprintable():
            return None
        if type(phase) is not str or phase not in PHASES:
            return None
        if loss is not None and type(loss) is not float:
            return None  # ints, and non-finite losses in their wire spelling: the full path
        if cs is not None and (type(cs) is not int or not 0 <= cs < MAX_INT):
            return None
        if obj.get("resume_skips") is not None:  # rare (after a rollback): the full path
            return None
        # evidence records (a stalled rank's wavefront) are rare too
        if obj.get("collectives") is not None or obj.get("progress", True) is not True:
            return None
        errors = obj.get("client_errors")
        if errors is not None:
            # a rank whose sends ever failed sends its counters with every record after:
            # it must not fall to the slow path for good (issue 16's profile)
            if type(errors) is not dict or len(errors) > MAX_CLIENT_ERRORS:
                return None
            for reason, count in errors.items():
                if type(count) is not int or not 0 <= count < MAX_INT:
                    return None
                if not is_reason_name(reason):
                    return None
            errors = dict(errors) or None
        for name in OPTIONAL_FLOAT_FIELDS:
            x = obj.get(name)
            if x is not None and (type(x) is not float or not 0.0 <= x < math.inf):
                return None
            values[name] = x
        uuid = obj.get("gpu_uuid")
        if uuid is not None and not is_gpu_uuid(uuid):
            return None
    except KeyError:
        return None
    values.update(job=job, phase=phase, loss=loss, checkpoint_step=cs, client_errors=errors,
                  resume_skips=None, gpu_uuid=uuid, collectives=None, progress=True)  # fmt: skip
    record = object.__new__(TelemetryRecord)
    record.__dict__.update(values)  # frozen: no __setattr__, but a plain instance dict
    return record


def decode(data: bytes) -> TelemetryRecord:
    """Parse and validate one datagram.

    Raises :class:`TelemetryError` for every malformed input, never anything else
    (``TypeError`` only when ``data`` is not bytes-like at all, a caller bug).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > MAX_DATAGRAM_BYTES:
        raise TelemetryError("too_large", f"datagram is {size} bytes > {MAX_DATAGRAM_BYTES}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TelemetryError("not_utf8", f"datagram is not valid UTF-8: {e.reason}") from None
    # Cheap guard first (C-speed counts); the exact scan only for odd inputs.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _json_depth(text) > MAX_JSON_DEPTH:
        raise TelemetryError("not_json", f"JSON nested deeper than {MAX_JSON_DEPTH}")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TelemetryError("not_json", f"datagram is not JSON: {e}"[:200]) from None
    if not isinstance(obj, dict):
        raise TelemetryError(
            "not_object", f"datagram is a JSON {type(obj).__name__}, not an object"
        )
    return fast_record(obj) or TelemetryRecord.from_dict(obj)
