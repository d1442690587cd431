"""The agent's JSON answers, `/v1/node` and `/v1/ranks`, as typed models.

The agent builds its answers from these classes (``to_json``), the supervisor and the
scale simulator's clients read them back (``from_json``), so the wire format is written
once. ``from_json`` checks every field's type and range and raises one error type,
:class:`~.errors.ContractError`, naming the field (``ranks[2].recent[5].step``) and
saying why; it never raises anything else for any JSON value. Unknown fields are ignored
(an agent may add fields within ``API_VERSION``); every field listed here is required,
present as ``null`` when it has no value. ``to_json`` gives plain JSON values with
non-finite numbers in their wire spelling (``contract/numbers.py``); only losses may be
non-finite.

Two shapes of ``/v1/ranks``: without ``?after=`` (the legacy answer) samples carry no
``seq`` and ranks no ``recent_from``; with it (an incremental read, ``contract/cursor.py``)
every sample has its ``seq``, every rank its ``recent_from`` and the answer its
``cursor``, ``full`` and ``full_reason``. :attr:`RanksAnswer.incremental` says which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import ContractError
from .numbers import decode_float, encode_float
from .states import LIVE_STATES, RANK_SOURCES, RANK_STATES, STAND_IN_STATES
from .telemetry import (
    MAX_CLIENT_ERRORS,
    MAX_COLLECTIVES,
    MAX_JOB_CHARS,
    MAX_OP_CHARS,
    MAX_PG_CHARS,
    MAX_REASON_CHARS,
    MAX_SHAPE_CHARS,
    PHASES,
    Collective,
    check_collectives,
    check_skip_ranges,
    is_gpu_uuid,
)

__all__ = [
    "API_VERSION",
    "GPU_SOURCES",
    "NODE_STATUSES",
    "CollectiveAnswer",
    "CollectorStatus",
    "HealthReason",
    "MainThreadAnswer",
    "NodeAnswer",
    "NodeWarning",
    "RankAnswer",
    "RankGpuAnswer",
    "RankEventAnswer",
    "RankEventsAnswer",
    "RanksAnswer",
    "Sample",
    "TelemetryStats",
]

#: The ``api`` field of every agent answer.
API_VERSION = "rankguard.agent/v1"
#: A node's verdict, best first.
NODE_STATUSES = ("healthy", "degraded", "unhealthy")

_MAX_INT = 2**63
_MAX_RANKS = 65536  # per answer: far above any node, far below a memory problem
_MAX_SAMPLES = 4096  # per rank
_MAX_TEXT = 4096  # free-text fields (state details, messages, errors)

T = TypeVar("T")


# --------------------------------------------------------------------------- field readers


def _object(value: Any, field: str | None = None) -> Mapping[str, Any]:
    """An object: a whole model (``field`` None, named by its parent) or one field."""
    if not isinstance(value, Mapping):
        what = f"{field}: expected" if field else "expected"
        raise ContractError("not_object", f"{what} an object, got {_kind(value)}", field)
    return value


def _get(obj: Mapping[str, Any], name: str) -> Any:
    if name not in obj:
        raise ContractError("missing_field", f"{name}: missing", name)
    return obj[name]


def _int(obj: Mapping[str, Any], name: str, minimum: int = 0, optional: bool = False) -> Any:
    value = _get(obj, name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError("bad_type", f"{name}: expected an integer, got {_kind(value)}", name)
    if not minimum <= value < _MAX_INT:
        raise ContractError("out_of_range", f"{name}: not in [{minimum}, 2**63)", name)
    return value


def _float(obj: Mapping[str, Any], name: str, optional: bool = False, finite: bool = True) -> Any:
    value = _get(obj, name)
    if value is None and optional:
        return None
    return decode_float(value, name, finite=finite)


def _str(
    obj: Mapping[str, Any],
    name: str,
    optional: bool = False,
    choices: tuple[str, ...] | None = None,
    max_chars: int = _MAX_TEXT,
) -> Any:
    value = _get(obj, name)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ContractError("bad_type", f"{name}: expected a string, got {_kind(value)}", name)
    if choices is not None and value not in choices:
        raise ContractError(
            "out_of_range", f"{name}: {value[:32]!r} is not one of {', '.join(choices)}", name
        )
    if len(value) > max_chars:
        raise ContractError("out_of_range", f"{name}: longer than {max_chars} characters", name)
    return value


def _bool(obj: Mapping[str, Any], name: str) -> bool:
    value = _get(obj, name)
    if not isinstance(value, bool):
        raise ContractError("bad_type", f"{name}: expected true or false, got {_kind(value)}", name)
    return value


def _list(
    obj: Mapping[str, Any], name: str, item: Callable[[Any], T], max_items: int
) -> tuple[T, ...]:
    value = _get(obj, name)
    if not isinstance(value, list):
        raise ContractError("bad_type", f"{name}: expected a list, got {_kind(value)}", name)
    if len(value) > max_items:
        raise ContractError("out_of_range", f"{name}: more than {max_items} items", name)
    out = []
    for i, v in enumerate(value):
        try:
            out.append(item(v))
        except ContractError as e:
            raise e.within(f"{name}[{i}]") from None
    return tuple(out)


def _counts(obj: Mapping[str, Any], name: str, max_items: int) -> dict[str, int]:
    """An object of reason -> count (a counter by reason)."""
    value = _object(_get(obj, name), name)
    if len(value) > max_items:
        raise ContractError("out_of_range", f"{name}: more than {max_items} entries", name)
    out = {}
    for key in value:
        if not isinstance(key, str) or len(key) > MAX_REASON_CHARS:
            raise ContractError("out_of_range", f"{name}: {str(key)[:40]!r} is no reason", name)
        try:
            out[key] = _int(value, key)
        except ContractError as e:
            raise e.within(name) from None
    return out


def _nested(obj: Mapping[str, Any], name: str, build: Callable[[Any], T]) -> T:
    try:
        return build(_get(obj, name))
    except ContractError as e:
        if e.reason == "missing_field" and e.field == name:
            raise
        raise e.within(name) from None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _finite_or_none(x: float | None) -> float | None:
    """The wire form of a float that must be finite (a bug if not: refuse to hide it)."""
    if x is not None and not math.isfinite(x):
        raise ValueError(f"{x!r} is not finite")
    return x


# --------------------------------------------------------------------------- /v1/ranks


@dataclass(frozen=True)
class Sample:
    """One timed step of a rank's ``recent`` window."""

    step: int
    phase: str
    restart: int
    pid: int
    step_seconds: float
    data_wait_seconds: float
    compute_seconds: float
    comm_seconds: float
    loss: float | None
    seq: int | None = None  # the agent's sample number; incremental answers only
    # the part of compute the rank waited for a CPU (run-queue wait); None: unknown (an
    # older client or agent), and then left out of the answer
    compute_wait_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "step": self.step,
            "phase": self.phase,
            "restart": self.restart,
            "pid": self.pid,
            "step_seconds": self.step_seconds,
            "data_wait_seconds": self.data_wait_seconds,
            "compute_seconds": self.compute_seconds,
            "comm_seconds": self.comm_seconds,
            "loss": encode_float(self.loss),
        }
        if self.seq is not None:
            out["seq"] = self.seq
        if self.compute_wait_seconds is not None:
            out["compute_wait_seconds"] = self.compute_wait_seconds
        return out

    @classmethod
    def from_json(cls, obj: Any, incremental: bool = False) -> Sample:
        fast = _sample_fast(obj, incremental)
        return fast if fast is not None else cls._read(obj, incremental)

    @classmethod
    def _read(cls, obj: Any, incremental: bool = False) -> Sample:
        """Every check, one field at a time: what an answer the fast path declines gets,
        and where its error (the first bad field, named) comes from."""
        o = _object(obj)
        return cls(
            step=_int(o, "step"),
            phase=_str(o, "phase", choices=PHASES),
            restart=_int(o, "restart"),
            pid=_int(o, "pid"),
            step_seconds=_float(o, "step_seconds"),
            data_wait_seconds=_float(o, "data_wait_seconds"),
            compute_seconds=_float(o, "compute_seconds"),
            comm_seconds=_float(o, "comm_seconds"),
            loss=_float(o, "loss", optional=True, finite=False),
            seq=_int(o, "seq") if incremental else None,
            # optional on the wire: absent from an older agent's (or client's) samples
            compute_wait_seconds=None
            if o.get("compute_wait_seconds") is None
            else _float(o, "compute_wait_seconds"),
        )


@dataclass(frozen=True)
class StandInAnswer:
    """The process torchrun started for a rank that runs in another one (warm start's shim):
    torchrun watches it, so a stopped stand-in hides its rank's exit (agent/stand_ins.py)."""

    pid: int
    state: str  # STAND_IN_STATES
    state_since: float

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "state": self.state, "state_since": self.state_since}

    @classmethod
    def from_json(cls, obj: Any) -> StandInAnswer:
        o = _object(obj)
        return cls(
            pid=_int(o, "pid", minimum=1),
            state=_str(o, "state", choices=STAND_IN_STATES),
            state_since=_float(o, "state_since"),
        )


#: How the agent knows a rank's GPU: its own records name it, or NVML lists its pid.
GPU_SOURCES = ("reported", "nvml")
#: How far back a GPU's XIDs count as news for the ranks on it.
XID_RECENT_SECONDS = 600.0
_MAX_THROTTLE = 16


@dataclass(frozen=True)
class RankGpuAnswer:
    """The GPU a rank computes on, and that GPU's faults as its node's agent sees them:
    the NVML UUID, how it is known (``GPU_SOURCES``), its index on the node (None when
    NVML does not list that UUID: a lost GPU, or no NVML), the XIDs of the last
    ``XID_RECENT_SECONDS`` by code, its volatile uncorrected ECC count, and the clock
    events that slow it down (thermal, power brake, hardware slowdown)."""

    uuid: str
    source: str
    index: int | None = None
    lost: bool = False  # NVML says the GPU is gone (fallen off the bus, needs a reset)
    xid_recent: Mapping[str, int] = field(default_factory=dict)
    ecc_uncorrected: int | None = None
    throttle: tuple[str, ...] = ()

    def faults(self) -> list[str]:
        """The GPU's faults in words, for an incident's summary; empty when healthy."""
        out = ["lost"] if self.lost else []
        out += [f"XID {code} x{n} in the last {XID_RECENT_SECONDS / 60:.0f} min"
                for code, n in sorted(self.xid_recent.items(), key=lambda kv: int(kv[0]))]  # fmt: skip
        if self.ecc_uncorrected:
            out.append(f"{self.ecc_uncorrected} uncorrected ECC errors")
        if self.throttle:
            out.append(f"throttled ({', '.join(self.throttle)})")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "source": self.source, "index": self.index, "lost": self.lost,
                "xid_recent": dict(self.xid_recent), "ecc_uncorrected": self.ecc_uncorrected,
                "throttle": list(self.throttle)}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> RankGpuAnswer:
        o = _object(obj)
        uuid = _str(o, "uuid")
        if not is_gpu_uuid(uuid):
            raise ContractError("out_of_range", f"uuid: {uuid[:40]!r} is no GPU UUID", "uuid")
        xids = _counts(o, "xid_recent", MAX_CLIENT_ERRORS)
        if not all(code.isdigit() for code in xids):
            raise ContractError("out_of_range", "xid_recent: codes are numbers", "xid_recent")
        return cls(
            uuid=uuid,
            source=_str(o, "source", choices=GPU_SOURCES),
            index=_int(o, "index", optional=True),
            lost=_bool(o, "lost"),
            xid_recent=xids,
            ecc_uncorrected=_int(o, "ecc_uncorrected", optional=True),
            throttle=_list(o, "throttle", _reason_name, _MAX_THROTTLE),
        )


def _reason_name(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_REASON_CHARS:
        raise ContractError("out_of_range", f"{str(value)[:40]!r} is no reason name")
    return value


_MAX_WCHAN = 512  # the kernel's longest symbol name (KSYM_NAME_LEN)
_MAX_SYSCALL = 32


@dataclass(frozen=True)
class MainThreadAnswer:
    """A rank's main thread (tid == pid) as the kernel shows it. On NCCL the process's CPU
    says nothing (the proxy and watchdog threads poll, a waiting main thread spins in a
    CUDA sync); the main thread's own run time, state and where it sleeps say more.
    ``state``: the kernel's letter (R running, S sleeping, D uninterruptible, T stopped);
    ``run_seconds``: its time on a CPU so far (schedstat); ``utilization``: of a core over
    the agent's last window; ``active_at``: when it last ran at least 0.05 cores over a
    window (Unix time); ``wchan``: the kernel function it sleeps in; ``syscall``: the
    number of the system call it is blocked in, "-1" blocked outside one, "running"
    (/proc/<pid>/syscall); both null when unknown or not asleep."""

    state: str
    run_seconds: float
    active_at: float
    utilization: float | None = None
    wchan: str | None = None
    syscall: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "run_seconds": self.run_seconds,
                "active_at": self.active_at, "utilization": self.utilization,
                "wchan": self.wchan, "syscall": self.syscall}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> MainThreadAnswer:
        o = _object(obj)
        state = _str(o, "state", max_chars=1)
        if len(state) != 1 or not (state.isascii() and state.isalpha()):
            raise ContractError("out_of_range", f"state: {state!r} is no kernel state", "state")
        return cls(
            state=state,
            run_seconds=_float(o, "run_seconds"),
            active_at=_float(o, "active_at"),
            utilization=_float(o, "utilization", optional=True),
            wchan=_str(o, "wchan", optional=True, max_chars=_MAX_WCHAN),
            syscall=_str(o, "syscall", optional=True, max_chars=_MAX_SYSCALL),
        )


#: One process group's place in its collectives, as the rank's flight recorder last showed
#: it (``pg``, ``desc``, ``enqueued``, ``completed``, ``op``, ``shape``, ``timeout_s``): the
#: agent passes the rank's own report on, so it is the telemetry contract's class, checked
#: by the same rules (contract/telemetry.py), not a second definition to drift from it.
CollectiveAnswer = Collective


#: RankAnswer's float fields that may be null (each finite when set), in answer order.
_RANK_FLOATS = (
    "step_seconds",
    "data_wait_seconds",
    "compute_seconds",
    "comm_seconds",
    "comm_exposed_seconds",
    "optimizer_seconds",
    "checkpoint_block_seconds",
    "comm_compute_ratio",
    "tokens_per_second",
    "mfu",
)


@dataclass(frozen=True)
class RankAnswer:
    """One rank as ``/v1/ranks`` shows it. A rank found in /proc (``source`` "process")
    has no step, phase, heartbeat, loss, checkpoint step or peak memory: those are null.
    ``up`` is exactly ``state in LIVE_STATES`` (``contract/states.py``)."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    pid: int
    restart: int
    state: str
    source: str = "telemetry"
    process_changes: int = 0
    state_detail: str | None = None
    state_since: float = 0.0
    exit_code: int | None = None
    exited_at: float | None = None
    first_seen_at: float = 0.0
    step: int | None = None
    phase: str | None = None
    heartbeat_age_seconds: float | None = None
    last_heartbeat_at: float | None = None
    timed_step: int | None = None
    step_seconds: float | None = None
    data_wait_seconds: float | None = None
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    comm_exposed_seconds: float | None = None
    optimizer_seconds: float | None = None
    checkpoint_block_seconds: float | None = None
    comm_compute_ratio: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    loss: float | None = None
    peak_memory_bytes: int | None = None
    checkpoint_step: int | None = None
    cpu_seconds: float | None = None
    cpu_utilization: float | None = None
    cpu_active_at: float = 0.0
    records_received: int = 0
    # the client library's failure counters, by reason, from the rank's newest record
    client_errors: Mapping[str, int] = field(default_factory=dict)
    # data steps the rank's resume skipped (a loss spike's window), from its newest record
    resume_skips: tuple[tuple[int, int], ...] = ()
    stand_in: StandInAnswer | None = None  # warm start: the shim torchrun watches
    gpu: RankGpuAnswer | None = None  # the GPU it computes on, when known
    main_thread: MainThreadAnswer | None = None  # its main thread's own state, when readable
    # its flight recorder's wavefront, from its newest progress=false record (a stall's
    # evidence), and how old that record is; () and None when it never sent one (or
    # since its process was replaced)
    collectives: tuple[CollectiveAnswer, ...] = ()
    collectives_age_seconds: float | None = None
    # a zero-code worker's optimizer step, from its watch (None for a telemetry rank, whose
    # `step` is its own, and for a worker whose step is not known)
    script_step: int | None = None
    recent: tuple[Sample, ...] = ()
    recent_from: int | None = None  # incremental answers: the window's oldest seq

    @property
    def up(self) -> bool:
        return self.state in LIVE_STATES

    def to_json(self, incremental: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "job": self.job,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "restart": self.restart,
            "process_changes": self.process_changes,
            "state": self.state,
            "up": self.up,
            "state_detail": self.state_detail,
            "source": self.source,
            "state_since": self.state_since,
            "exit_code": self.exit_code,
            "exited_at": self.exited_at,
            "first_seen_at": self.first_seen_at,
            "step": self.step,
            "phase": self.phase,
            "heartbeat_age_seconds": self.heartbeat_age_seconds,
            "last_heartbeat_at": self.last_heartbeat_at,
            "timed_step": self.timed_step,
        }
        for name in _RANK_FLOATS:
            out[name] = _finite_or_none(getattr(self, name))
        out.update(
            loss=encode_float(self.loss),
            peak_memory_bytes=self.peak_memory_bytes,
            checkpoint_step=self.checkpoint_step,
            cpu_seconds=self.cpu_seconds,
            cpu_utilization=self.cpu_utilization,
            cpu_active_at=self.cpu_active_at,
            records_received=self.records_received,
            client_errors=dict(self.client_errors),
            stand_in=self.stand_in.to_json() if self.stand_in else None,
        )
        if self.resume_skips:  # left out when none: most ranks never skip (answer size)
            out["resume_skips"] = [list(r) for r in self.resume_skips]
        if self.gpu is not None:  # left out when unknown (a CPU rank, an older agent)
            out["gpu"] = self.gpu.to_json()
        if self.main_thread is not None:  # left out when unknown (gone, an older agent)
            out["main_thread"] = self.main_thread.to_json()
        if self.collectives:  # left out when none: only a stalled rank sends them
            out["collectives"] = [c.to_json() for c in self.collectives]
        if self.collectives_age_seconds is not None:
            out["collectives_age_seconds"] = _finite_or_none(self.collectives_age_seconds)
        if self.script_step is not None:  # left out when unknown: only zero-code workers
            out["script_step"] = self.script_step
        if incremental:
            out["recent_from"] = self.recent_from
        out["recent"] = [s.to_json() for s in self.recent]
        return out

    @classmethod
    def from_json(cls, obj: Any, incremental: bool = False) -> RankAnswer:
        fast = _rank_fast(obj, incremental)
        return fast if fast is not None else cls._read(obj, incremental)

    @classmethod
    def _read(cls, obj: Any, incremental: bool = False) -> RankAnswer:
        """Every check, one field at a time (see Sample._read)."""
        o = _object(obj)
        state = _str(o, "state", choices=RANK_STATES)
        if _bool(o, "up") != (state in LIVE_STATES):
            raise ContractError("out_of_range", f"up: contradicts state {state!r}", "up")
        world_size = _int(o, "world_size", minimum=1)
        rank = _int(o, "rank")
        if rank >= world_size:
            raise ContractError("out_of_range", f"rank: {rank} >= world_size {world_size}", "rank")
        return cls(
            job=_str(o, "job", max_chars=MAX_JOB_CHARS),
            rank=rank,
            local_rank=_int(o, "local_rank"),
            world_size=world_size,
            pid=_int(o, "pid"),
            restart=_int(o, "restart"),
            state=state,
            source=_str(o, "source", choices=RANK_SOURCES),
            process_changes=_int(o, "process_changes"),
            state_detail=_str(o, "state_detail", optional=True),
            state_since=_float(o, "state_since"),
            exit_code=_int(o, "exit_code", optional=True),
            exited_at=_float(o, "exited_at", optional=True),
            first_seen_at=_float(o, "first_seen_at"),
            step=_int(o, "step", optional=True),
            phase=_str(o, "phase", optional=True, choices=PHASES),
            heartbeat_age_seconds=_float(o, "heartbeat_age_seconds", optional=True),
            last_heartbeat_at=_float(o, "last_heartbeat_at", optional=True),
            timed_step=_int(o, "timed_step", optional=True),
            **{name: _float(o, name, optional=True) for name in _RANK_FLOATS},
            loss=_float(o, "loss", optional=True, finite=False),
            peak_memory_bytes=_int(o, "peak_memory_bytes", optional=True),
            checkpoint_step=_int(o, "checkpoint_step", optional=True),
            cpu_seconds=_float(o, "cpu_seconds", optional=True),
            cpu_utilization=_float(o, "cpu_utilization", optional=True),
            cpu_active_at=_float(o, "cpu_active_at"),
            records_received=_int(o, "records_received"),
            client_errors=_counts(o, "client_errors", MAX_CLIENT_ERRORS),
            # optional on the wire: an agent from before issue 20's skips does not send it
            resume_skips=()
            if o.get("resume_skips") is None
            else check_skip_ranges("resume_skips", o["resume_skips"]),
            stand_in=None
            if o.get("stand_in") is None
            else _nested(o, "stand_in", StandInAnswer.from_json),
            gpu=None if o.get("gpu") is None else _nested(o, "gpu", RankGpuAnswer.from_json),
            main_thread=None
            if o.get("main_thread") is None
            else _nested(o, "main_thread", MainThreadAnswer.from_json),
            # optional on the wire: absent when none, and from an older agent
            collectives=check_collectives(o.get("collectives")) or (),
            collectives_age_seconds=_float(o, "collectives_age_seconds", optional=True)
            if "collectives_age_seconds" in o
            else None,
            script_step=_int(o, "script_step", optional=True) if "script_step" in o else None,
            recent=_list(o, "recent", lambda s: Sample.from_json(s, incremental), _MAX_SAMPLES),
            recent_from=_int(o, "recent_from", optional=True) if incremental else None,
        )


# --------------------------------------------------------------------------- fast paths
#
# The supervisor reads every rank of every node on every pass: at 1,024 nodes the
# field-by-field checks above were most of its CPU (docs/scaling.md). A fast path checks
# a usual answer with a few type() tests per field and builds the same object; anything
# it is not sure of (an int where a float goes, a non-finite loss, client errors, a
# stand-in, any bad value) returns None and goes through the checked read, which then
# accepts it or names the bad field exactly as before. It accepts only what the checked
# read accepts, with the same result (a property test, tests/contract/test_contract.py).

_PHASE_SET = frozenset(PHASES)
_STATE_SET = frozenset(RANK_STATES)
_SOURCE_SET = frozenset(RANK_SOURCES)
_SAMPLE_FLOATS = ("step_seconds", "data_wait_seconds", "compute_seconds", "comm_seconds")
_RANK_INTS = ("rank", "local_rank", "pid", "restart", "process_changes", "records_received")
_RANK_OPT_INTS = ("exit_code", "step", "timed_step", "peak_memory_bytes", "checkpoint_step")
_RANK_REQ_FLOATS = ("state_since", "first_seen_at", "cpu_active_at")
_RANK_OPT_FLOATS = (
    "exited_at",
    "heartbeat_age_seconds",
    "last_heartbeat_at",
    *_RANK_FLOATS,
    "cpu_seconds",
    "cpu_utilization",
)


def _nat(v: Any) -> bool:
    """An int in [0, 2**63), as _int accepts it (bools are not ints here)."""
    return type(v) is int and 0 <= v < _MAX_INT


def _fin(v: Any) -> bool:
    """A finite float (an int goes the checked way: it is converted there)."""
    return type(v) is float and v - v == 0.0


def _sample_fast(o: Any, incremental: bool) -> Sample | None:
    if type(o) is not dict:
        return None
    try:
        step, phase, restart, pid = o["step"], o["phase"], o["restart"], o["pid"]
        a, b, c, d = (o[k] for k in _SAMPLE_FLOATS)
        loss = o["loss"]
        seq = o["seq"] if incremental else None
        wait = o.get("compute_wait_seconds")
    except KeyError:
        return None
    if not (
        _nat(step)
        and type(phase) is str
        and phase in _PHASE_SET
        and _nat(restart)
        and _nat(pid)
        and _fin(a)
        and _fin(b)
        and _fin(c)
        and _fin(d)
        and (loss is None or _fin(loss))
        and (not incremental or _nat(seq))
        and (wait is None or _fin(wait))
    ):
        return None
    return Sample(step, phase, restart, pid, a, b, c, d, loss, seq, wait)


def _rank_fast(o: Any, incremental: bool) -> RankAnswer | None:
    if type(o) is not dict or o.get("resume_skips") is not None:  # rare: the checked read
        return None
    try:
        state, up, job, source = o["state"], o["up"], o["job"], o["source"]
        world_size, detail, phase, loss = o["world_size"], o["state_detail"], o["phase"], o["loss"]
        errors, stand_in, recent = o["client_errors"], o["stand_in"], o["recent"]
        ints = [o[k] for k in _RANK_INTS]
        opt_ints = [o[k] for k in _RANK_OPT_INTS]
        req_floats = [o[k] for k in _RANK_REQ_FLOATS]
        opt_floats = [o[k] for k in _RANK_OPT_FLOATS]
        recent_from = o["recent_from"] if incremental else None
    except KeyError:
        return None
    if not (
        type(state) is str
        and state in _STATE_SET
        and type(up) is bool
        and up == (state in LIVE_STATES)
        and type(job) is str
        and len(job) <= MAX_JOB_CHARS
        and type(source) is str
        and source in _SOURCE_SET
        and type(world_size) is int
        and 1 <= world_size < _MAX_INT
        and (detail is None or (type(detail) is str and len(detail) <= _MAX_TEXT))
        and (phase is None or (type(phase) is str and phase in _PHASE_SET))
        and (loss is None or _fin(loss))
        and type(errors) is dict
        and not errors
        and stand_in is None
        and type(recent) is list
        and len(recent) <= _MAX_SAMPLES
        and all(map(_nat, ints))
        and ints[0] < world_size  # rank
        and all(v is None or _nat(v) for v in opt_ints)
        and all(map(_fin, req_floats))
        and all(v is None or _fin(v) for v in opt_floats)
        and (recent_from is None or _nat(recent_from))
    ):
        return None
    gpu = o.get("gpu")
    if gpu is not None:  # every rank of a GPU job: checked here, not a reason to go slow
        try:
            gpu = RankGpuAnswer.from_json(gpu)
        except ContractError:
            return None
    main = o.get("main_thread")
    if main is not None:  # every live rank: a few type tests, as for the rank itself
        main = _main_thread_fast(main)
        if main is None:
            return None
    collectives = o.get("collectives")
    if collectives is not None:  # a stalled rank's: checked here too
        collectives = _collectives_fast(collectives)
        if collectives is None:
            return None
    age = o.get("collectives_age_seconds")
    if age is not None and not _fin(age):
        return None
    script_step = o.get("script_step")  # optional on the wire: a zero-code worker's
    if script_step is not None and not _nat(script_step):
        return None
    samples = []
    for item in recent:
        sample = _sample_fast(item, incremental)
        if sample is None:
            return None
        samples.append(sample)
    rank, local_rank, pid, restart, process_changes, records_received = ints
    exit_code, step, timed_step, peak_memory_bytes, checkpoint_step = opt_ints
    state_since, first_seen_at, cpu_active_at = req_floats
    exited_at, heartbeat_age, last_heartbeat_at, *rest = opt_floats
    cpu_seconds, cpu_utilization = rest[-2:]
    return RankAnswer(
        job=job, rank=rank, local_rank=local_rank, world_size=world_size, pid=pid,
        restart=restart, state=state, source=source, process_changes=process_changes,
        state_detail=detail, state_since=state_since, exit_code=exit_code,
        exited_at=exited_at, first_seen_at=first_seen_at, step=step, phase=phase,
        heartbeat_age_seconds=heartbeat_age, last_heartbeat_at=last_heartbeat_at,
        timed_step=timed_step, **dict(zip(_RANK_FLOATS, rest[:-2], strict=True)),
        loss=loss, peak_memory_bytes=peak_memory_bytes, checkpoint_step=checkpoint_step,
        cpu_seconds=cpu_seconds, cpu_utilization=cpu_utilization,
        cpu_active_at=cpu_active_at, records_received=records_received, client_errors={},
        stand_in=None, gpu=gpu, main_thread=main, collectives=collectives or (),
        collectives_age_seconds=age, script_step=script_step, recent=tuple(samples),
        recent_from=recent_from,
    )  # fmt: skip


def _main_thread_fast(o: Any) -> MainThreadAnswer | None:
    if type(o) is not dict:
        return None
    try:
        state, run, active, util = o["state"], o["run_seconds"], o["active_at"], o["utilization"]
        wchan, syscall = o["wchan"], o["syscall"]
    except KeyError:
        return None
    if not (
        type(state) is str
        and len(state) == 1
        and state.isascii()
        and state.isalpha()
        and _fin(run)
        and _fin(active)
        and (util is None or _fin(util))
        and (wchan is None or (type(wchan) is str and len(wchan) <= _MAX_WCHAN))
        and (syscall is None or (type(syscall) is str and len(syscall) <= _MAX_SYSCALL))
    ):
        return None
    return MainThreadAnswer(state, run, active, util, wchan, syscall)


def _text_ok(v: Any, low: int, high: int) -> bool:
    return type(v) is str and low <= len(v) <= high and v.isprintable()


def _collectives_fast(value: Any) -> tuple[CollectiveAnswer, ...] | None:
    """A wavefront whose every value has its exact type and is in range (Collective's
    rules, contract/telemetry.py), built without the constructor's checks; None for
    anything else, which the checked read then accepts or names."""
    if type(value) is not list or len(value) > MAX_COLLECTIVES:
        return None
    out = []
    for o in value:
        if type(o) is not dict:
            return None
        try:
            pg, desc, enqueued, completed = o["pg"], o["desc"], o["enqueued"], o["completed"]
            op, shape, timeout = o["op"], o["shape"], o["timeout_s"]
        except KeyError:
            return None
        if not (
            _text_ok(pg, 1, MAX_PG_CHARS)
            and _text_ok(desc, 0, MAX_PG_CHARS)
            and type(enqueued) is int
            and -1 <= enqueued < _MAX_INT
            and type(completed) is int
            and -1 <= completed < _MAX_INT
            and (op is None or _text_ok(op, 1, MAX_OP_CHARS))
            and (shape is None or _text_ok(shape, 0, MAX_SHAPE_CHARS))
            and (timeout is None or (_fin(timeout) and timeout > 0.0))
        ):
            return None
        c = object.__new__(CollectiveAnswer)  # frozen: filled through its instance dict
        c.__dict__.update(pg=pg, desc=desc, enqueued=enqueued, completed=completed, op=op,
                          shape=shape, timeout_s=timeout)  # fmt: skip
        out.append(c)
    if len({c.pg for c in out}) != len(out):
        return None
    return tuple(out)


@dataclass(frozen=True)
class TelemetryStats:
    """The agent's telemetry receiver: records accepted, datagrams rejected by reason."""

    path: str = ""
    accepted: int = 0
    rejected: Mapping[str, int] = field(default_factory=dict)
    last_error: Mapping[str, str] = field(default_factory=dict)
    # when the receiver last saw signs of lost records (a quota refusal, a full queue):
    # Unix time, None for never; optional on the wire (older agents do not send it)
    pressure_at: float | None = None

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "accepted": self.accepted, "rejected": dict(self.rejected),
                "rejected_total": self.rejected_total,
                "last_error": dict(self.last_error), "pressure_at": self.pressure_at}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> TelemetryStats:
        o = _object(obj)
        rejected = _counts(o, "rejected", 64)
        if _int(o, "rejected_total") != sum(rejected.values()):
            raise ContractError("out_of_range", "rejected_total: not the sum", "rejected_total")
        last = _object(_get(o, "last_error"), "last_error")
        for key in last:
            _str(last, key)
        pressure = _float(o, "pressure_at", optional=True) if "pressure_at" in o else None
        return cls(path=_str(o, "path"), accepted=_int(o, "accepted"), rejected=rejected,
                   last_error=dict(last), pressure_at=pressure)  # fmt: skip


@dataclass(frozen=True)
class RanksAnswer:
    """``GET /v1/ranks``: the node's ranks and its telemetry receiver's counters; with a
    ``cursor`` (an incremental read) also whether the answer replaces everything."""

    node: str
    time: float
    ranks: tuple[RankAnswer, ...] = ()
    telemetry: TelemetryStats = field(default_factory=TelemetryStats)
    cursor: str | None = None
    full: bool = False
    full_reason: str | None = None

    @property
    def incremental(self) -> bool:
        return self.cursor is not None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "api": API_VERSION,
            "node": self.node,
            "time": self.time,
            "ranks": [r.to_json(self.incremental) for r in self.ranks],
            "telemetry": self.telemetry.to_json(),
        }
        if self.incremental:
            out.update(cursor=self.cursor, full=self.full, full_reason=self.full_reason)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> RanksAnswer:
        o = _object(obj)
        cursor = _str(o, "cursor", optional=True) if "cursor" in o else None
        incremental = cursor is not None
        return cls(
            node=_str(o, "node"),
            time=_float(o, "time"),
            ranks=_list(o, "ranks", lambda r: RankAnswer.from_json(r, incremental), _MAX_RANKS),
            telemetry=_nested(o, "telemetry", TelemetryStats.from_json),
            cursor=cursor,
            full=_bool(o, "full") if incremental else False,
            full_reason=_str(o, "full_reason", optional=True) if incremental else None,
        )


# --------------------------------------------------------------------------- /v1/rank-events

_MAX_EVENTS = 4096  # per answer: the agent keeps fewer (agent/rank_events.py)


@dataclass(frozen=True)
class RankEventAnswer:
    """One change of a rank's process state, as the agent saw it (its pidfd watcher for an
    exit, at once). ``restart`` is the incarnation the rank's records named when known;
    ``previous`` is None on first sight; ``seq`` numbers the agent's events; ``step`` is
    the rank's last reported step and ``checkpoint_step`` the newest validated checkpoint
    it last reported (None for a rank without telemetry, or none reported)."""

    seq: int
    job: str
    rank: int
    pid: int
    restart: int | None
    previous: str | None
    state: str
    at: float
    detail: str | None = None
    step: int | None = None
    checkpoint_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "job": self.job, "rank": self.rank, "pid": self.pid,
                "restart": self.restart, "previous": self.previous, "state": self.state,
                "at": self.at, "detail": self.detail, "step": self.step,
                "checkpoint_step": self.checkpoint_step}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> RankEventAnswer:
        o = _object(obj)
        return cls(
            seq=_int(o, "seq", minimum=1),
            job=_str(o, "job", max_chars=MAX_JOB_CHARS),
            rank=_int(o, "rank"),
            pid=_int(o, "pid"),
            restart=_int(o, "restart", optional=True),
            previous=_str(o, "previous", optional=True, choices=RANK_STATES),
            state=_str(o, "state", choices=RANK_STATES),
            at=_float(o, "at"),
            detail=_str(o, "detail", optional=True),
            step=_int(o, "step", optional=True),
            checkpoint_step=(  # absent from an older agent's events
                _int(o, "checkpoint_step", optional=True) if "checkpoint_step" in o else None
            ),
        )


@dataclass(frozen=True)
class RankEventsAnswer:
    """``GET /v1/rank-events?after=<cursor>&wait=<s>``: the rank state changes after the
    cursor, oldest first (contract/cursor.py: the same cursor form as ``/v1/ranks``, its
    own counter). ``full``: the cursor was not this agent's, or its events fell out of the
    agent's buffer; ``events`` is then all the agent holds, and some may be missing."""

    node: str
    time: float
    cursor: str
    full: bool = False
    full_reason: str | None = None
    events: tuple[RankEventAnswer, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"api": API_VERSION, "node": self.node, "time": self.time,
                "cursor": self.cursor, "full": self.full, "full_reason": self.full_reason,
                "events": [e.to_json() for e in self.events]}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> RankEventsAnswer:
        o = _object(obj)
        events = _list(o, "events", RankEventAnswer.from_json, _MAX_EVENTS)
        for i in range(1, len(events)):
            if events[i].seq <= events[i - 1].seq:
                raise ContractError(
                    "out_of_range", f"events[{i}].seq: not after the event before it",
                    f"events[{i}].seq",
                )  # fmt: skip
        return cls(
            node=_str(o, "node"),
            time=_float(o, "time"),
            cursor=_str(o, "cursor", max_chars=64),
            full=_bool(o, "full"),
            full_reason=_str(o, "full_reason", optional=True),
            events=events,
        )


# --------------------------------------------------------------------------- /v1/node


@dataclass(frozen=True)
class HealthReason:
    code: str
    severity: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "message": self.message}

    @classmethod
    def from_json(cls, obj: Any) -> HealthReason:
        o = _object(obj)
        return cls(code=_str(o, "code", max_chars=128),
                   severity=_str(o, "severity", choices=NODE_STATUSES),
                   message=_str(o, "message"))  # fmt: skip


@dataclass(frozen=True)
class CollectorStatus:
    success: bool
    duration_seconds: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"success": self.success, "duration_seconds": self.duration_seconds,
                "error": self.error}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> CollectorStatus:
        o = _object(obj)
        return cls(success=_bool(o, "success"),
                   duration_seconds=_float(o, "duration_seconds"),
                   error=_str(o, "error", optional=True))  # fmt: skip


@dataclass(frozen=True)
class NodeWarning:
    """Something an operator should fix that does not change the verdict (a checkpoint
    root others can write into, say)."""

    code: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_json(cls, obj: Any) -> NodeWarning:
        o = _object(obj)
        return cls(code=_str(o, "code", max_chars=128), message=_str(o, "message"))


@dataclass(frozen=True)
class NodeAnswer:
    """``GET /v1/node``: the node's verdict with reasons, each collector's last run, and
    the collectors' facts (free-form JSON objects, one per collector, for people and
    tools; the supervisor reads only the verdict). ``warnings`` were added within v1: an
    answer without them (an older agent) reads as having none."""

    node: str
    version: str
    time: float
    uptime_seconds: float
    status: str
    reasons: tuple[HealthReason, ...] = ()
    collectors: Mapping[str, CollectorStatus] = field(default_factory=dict)
    facts: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[NodeWarning, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "api": API_VERSION,
            "node": self.node,
            "version": self.version,
            "time": self.time,
            "uptime_seconds": self.uptime_seconds,
            "status": self.status,
            "reasons": [r.to_json() for r in self.reasons],
            "collectors": {name: c.to_json() for name, c in self.collectors.items()},
            "facts": dict(self.facts),
            "warnings": [w.to_json() for w in self.warnings],
        }

    @classmethod
    def from_json(cls, obj: Any) -> NodeAnswer:
        o = _object(obj)
        collectors = {}
        for name, c in _object(_get(o, "collectors"), "collectors").items():
            try:
                collectors[name] = CollectorStatus.from_json(c)
            except ContractError as e:
                raise e.within(f"collectors.{name}") from None
        return cls(
            node=_str(o, "node", max_chars=256),
            version=_str(o, "version", max_chars=128),
            time=_float(o, "time"),
            uptime_seconds=_float(o, "uptime_seconds"),
            status=_str(o, "status", choices=NODE_STATUSES),
            reasons=_list(o, "reasons", HealthReason.from_json, 1024),
            collectors=collectors,
            facts=dict(_object(_get(o, "facts"), "facts")),
            warnings=_list(o, "warnings", NodeWarning.from_json, 64) if "warnings" in o else (),
        )
