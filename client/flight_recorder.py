"""The rank's flight-recorder wavefront: where each of its process groups stands in the
group's sequence of collectives, read live from PyTorch's flight recorder while the job
is hung.

Every rank of a process group issues the group's collectives in the same order, and
torch numbers them per group (``collective_seq_id``). Its flight recorder keeps, per
group, the last id the rank enqueued and the last it saw complete (``pg_status``), and a
ring buffer of the collectives themselves (``entries``). Compared across ranks, these
name the culprit of a hang: the rank that never enqueued the collective the others wait
in (``supervisor/wavefront.py``). On NCCL and, from torch 2.13, on gloo.

* :func:`enable` turns the recorder on (its buffer size) for process groups created
  after it, never overriding what the user set: call it before ``init_process_group``.
  Torch reads the size once, when the first group creates the process-wide recorder.
* :func:`wavefront` is the pure part: a dump (the JSON torch writes) in, one
  :class:`~rankguard.contract.telemetry.Collective` per group out. Tested on literal
  dumps.
* :func:`read_wavefront` dumps the recorder(s) of this process and reads them; ``()``
  when there is nothing to read (no process group, recorder off, torch too old) or
  anything fails. It never raises. For a thread that looks again and again,
  :func:`read_status` reads the groups' sequence ids alone (a few hundred bytes; the
  entries are up to the buffer's 2,000, about a megabyte of JSON) and :func:`read` both
  (they raise, for the caller to count).

Torch is never imported here: a process that has not imported ``torch.distributed``
has no process group to read. The dump is safe from any thread while the main thread
is blocked in a collective (the recorder has its own lock; torch's own watchdog dumps it
from its thread), and it only reads: it issues no collective and waits on no device.

What torch 2.13 shows: on gloo an entry's ``state`` stays "scheduled" (so ``onlyActive``
filters nothing) and ``pg_status`` is what moves; point-to-point operations are not
numbered among the collectives (their entries are skipped here). NCCL's recorder is a
second one (``_dump_nccl_trace_json``, in CUDA builds only): both are read, and a group
found in both (a ``cpu:gloo,cuda:nccl`` group) keeps its name for NCCL's sequence and is
named ``<name>:gloo`` for gloo's, as the two count apart.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from importlib import metadata
from typing import Any

from ..contract.errors import ContractError
from ..contract.telemetry import (
    MAX_COLLECTIVES,
    MAX_OP_CHARS,
    MAX_PG_CHARS,
    MAX_SHAPE_CHARS,
    Collective,
)

__all__ = [
    "BUFFER_ENVS",
    "DEFAULT_BUFFER_SIZE",
    "DUMP_FILE_ENVS",
    "buffer_size",
    "enable",
    "read",
    "read_status",
    "read_wavefront",
    "wavefront",
]

#: The variables torch reads the recorder's size from, in the order it reads them (the
#: first one set wins). Torch before 2.8 reads only the second; a newer one prints a
#: deprecation warning for it in every rank (2.13 does), so it is set only for an older
#: torch.
BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: Where a recorder dumped on a collective timeout (NCCL's watchdog) writes: this prefix
#: and the rank. The same two spellings.
DUMP_FILE_ENVS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
#: Entries kept: torch's own default where it records by default.
DEFAULT_BUFFER_SIZE = 2000
# The recorders' dump functions, NCCL's first (where a GPU job's collectives go).
_DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")


def buffer_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """The recorder size torch will read from ``environ``: None when no variable is set
    (torch's default then: 2000 from torch 2.11, and for NCCL from 2.6), 0 when the value
    is not a whole number (taken as off)."""
    for name in BUFFER_ENVS:
        if name in environ:
            try:
                return max(0, int(environ[name]))
            except ValueError:
                return 0
    return None


@functools.cache
def _old_torch() -> bool:
    """Whether the installed torch predates the TORCH_FR_* names (2.8), by its package
    metadata: torch is not imported for it."""
    try:
        major, minor = (int(x) for x in metadata.version("torch").split(".")[:2])
    except Exception:  # not installed, or a version we cannot read: a current one
        return False
    return (major, minor) < (2, 8)


def _set(environ: MutableMapping[str, str], names: tuple[str, str], default: str) -> None:
    """The user's value (the first of ``names`` set) or ``default`` in the current name,
    and in the legacy one for a torch that reads only that; a value set is never
    changed."""
    value = next((environ[n] for n in names if n in environ), default)
    environ.setdefault(names[0], value)
    if _old_torch():
        environ.setdefault(names[1], value)


def enable(
    environ: MutableMapping[str, str] = os.environ,
    size: int = DEFAULT_BUFFER_SIZE,
    *,
    dump_to: str | None = None,
) -> bool:
    """Turn the flight recorder on for the process groups created after this call: sets
    ``TORCH_FR_BUFFER_SIZE`` to ``size`` (and ``TORCH_NCCL_TRACE_BUFFER_SIZE``, for a torch
    older than 2.8) unless the user set either; a value the user set is never overridden,
    and is copied to the name torch reads first, so the user's choice (0: off) holds.
    ``dump_to``: the file prefix a recorder dumped on a collective timeout writes to
    (``TORCH_FR_DUMP_TEMP_FILE``, the same way; its folder must exist). Returns whether
    recording will be on.

    Call it before the process group exists: torch reads the size once, when the first
    group creates the process-wide recorder; a later call changes nothing."""
    _set(environ, BUFFER_ENVS, str(size))
    if dump_to is not None:
        _set(environ, DUMP_FILE_ENVS, dump_to)
    return bool(buffer_size(environ))


# --------------------------------------------------------------------------- parsing


def _text(value: Any, limit: int) -> str | None:
    """A printable string of at most ``limit`` characters (others replaced by "?"), or
    None for anything that is not a string."""
    if not isinstance(value, str):
        return None
    value = value[:limit]
    return value if value.isprintable() else "".join(c if c.isprintable() else "?" for c in value)


def _seq(value: Any) -> int | None:
    """A sequence id as torch writes it (a decimal string; -1 for none yet)."""
    if isinstance(value, bool):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if -1 <= n < 2**63 else None


def _shape(sizes: Any) -> str | None:
    if not isinstance(sizes, list):
        return None
    try:
        return json.dumps(sizes, separators=(",", ":"))[:MAX_SHAPE_CHARS]
    except (TypeError, ValueError):
        return None


def _timeout(ms: Any) -> float | None:
    if isinstance(ms, bool) or not isinstance(ms, (int, float)):
        return None
    try:
        seconds = ms / 1000.0
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def _entries(dump: Mapping[str, Any]) -> tuple[dict[str, Any], dict[tuple[str, int], Any]]:
    """From the recorder's entries: each group's (name, description) by pg id, and the
    newest collective entry for each (pg id, sequence id)."""
    names: dict[str, Any] = {}
    by_seq: dict[tuple[str, int], Any] = {}
    entries = dump.get("entries")
    for e in entries if isinstance(entries, list) else ():
        if not isinstance(e, Mapping) or isinstance(e.get("pg_id"), bool):
            continue
        pg_id = str(e.get("pg_id"))
        name = e.get("process_group")
        if isinstance(name, list) and len(name) == 2:
            names[pg_id] = name
        seq = e.get("collective_seq_id")
        if not e.get("is_p2p") and isinstance(seq, int) and not isinstance(seq, bool):
            by_seq[(pg_id, seq)] = e  # entries are oldest first: the newest stays
    return names, by_seq


def _groups(dump: Any) -> list[Collective]:
    if not isinstance(dump, Mapping) or not isinstance(dump.get("pg_status"), Mapping):
        return []
    names, by_seq = _entries(dump)
    out = []
    for pg_id, status in dump["pg_status"].items():
        if not isinstance(status, Mapping):
            continue
        enqueued = _seq(status.get("last_enqueued_collective"))
        completed = _seq(status.get("last_completed_collective"))
        if enqueued is None or completed is None:
            continue
        pg_id = str(pg_id)
        name, desc = names.get(pg_id, (None, None))
        # the first collective it still waits in, else its last: what its peers' must match
        entry = by_seq.get((pg_id, completed + 1 if enqueued > completed else enqueued))
        entry = entry if isinstance(entry, Mapping) else {}
        try:
            out.append(
                Collective(
                    pg=_text(name, MAX_PG_CHARS) or _text(pg_id, MAX_PG_CHARS) or "?",
                    desc=_text(desc, MAX_PG_CHARS) or "",
                    enqueued=enqueued,
                    completed=completed,
                    op=_text(entry.get("profiling_name"), MAX_OP_CHARS) or None,
                    shape=_shape(entry.get("input_sizes")),
                    timeout_s=_timeout(entry.get("timeout_ms")),
                )
            )
        except ContractError:  # a value no rule takes: that group is left out
            continue
    return out


def _top(groups: list[Collective]) -> tuple[Collective, ...]:
    """Distinct names, the MAX_COLLECTIVES groups with the highest enqueued id first."""
    seen: set[str] = set()
    out = []
    for c in sorted(groups, key=lambda c: (-c.enqueued, c.pg)):
        if c.pg not in seen:
            seen.add(c.pg)
            out.append(c)
    return tuple(out[:MAX_COLLECTIVES])


def wavefront(dump: Any) -> tuple[Collective, ...]:
    """One :class:`Collective` per process group of a flight-recorder dump (the parsed
    JSON of ``_dump_fr_trace_json``): ``pg`` the group's name (``process_group[0]`` of its
    entries; its pg id when the buffer holds none), ``desc`` its description
    (``process_group[1]``), ``enqueued`` and ``completed`` its ``pg_status``, and from the
    entry of the first collective still pending (``completed + 1``), else of the last
    enqueued (when the buffer still holds it), ``op``
    (``profiling_name``), ``shape`` (``input_sizes`` as compact JSON, at most 64
    characters) and ``timeout_s``. At most 16 groups, the highest ``enqueued`` first.
    Anything unreadable gives ``()`` (a group that cannot be read is left out)."""
    return _top(_groups(dump))


def _merged(dumps: list[Any]) -> tuple[Collective, ...]:
    """NCCL's recorder's groups, then gloo's: a name in both is gloo's as "<name>:gloo"."""
    first = _groups(dumps[0]) if dumps else []
    names = {c.pg for c in first}
    rest = []
    for dump in dumps[1:]:
        for c in _groups(dump):
            if c.pg in names:
                pg = f"{c.pg[: MAX_PG_CHARS - 5]}:gloo"
                c = Collective(pg, c.desc, c.enqueued, c.completed, c.op, c.shape, c.timeout_s)
            rest.append(c)
    return _top(first + rest)


# --------------------------------------------------------------------------- reading


def _c10d() -> Any:
    """torch's c10d bindings when this process has a default process group, else None.
    Never imports torch: a process that has not has no group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return sys.modules["torch"]._C._distributed_c10d


def _dump(c10d: Any, collectives: bool) -> list[Any]:
    """Each recorder's dump, parsed (raises what torch raises)."""
    out = []
    for name in _DUMPS:
        fn = getattr(c10d, name, None)
        if fn is not None:
            # (includeCollectives, onlyActive): NCCL's recorder keeps completed entries
            # out; gloo's entries never complete, so its buffer comes whole
            out.append(json.loads(fn(collectives, True)))
    return out


def _status(dumps: list[Any]) -> list[Any] | None:
    """Every recorder's ``pg_status``: equal between two reads means nothing moved; None
    when no recorder has a group."""
    status = [d.get("pg_status") if isinstance(d, Mapping) else None for d in dumps]
    return status if any(status) else None


def read_status() -> list[Any] | None:
    """Each group's sequence ids alone, for a thread that looks again and again: a few
    hundred bytes where the whole dump is up to the buffer's 2,000 entries (about a
    megabyte of JSON). None when this process has no process group or its recorders none.
    Raises what torch raises."""
    c10d = _c10d()
    return None if c10d is None else _status(_dump(c10d, False))


def read() -> tuple[list[Any] | None, tuple[Collective, ...]]:
    """(the status it shows, as :func:`read_status` gives it; the wavefront). Raises what
    torch raises."""
    c10d = _c10d()
    if c10d is None:
        return None, ()
    dumps = _dump(c10d, True)
    return _status(dumps), _merged(dumps)


def read_wavefront() -> tuple[Collective, ...]:
    """This process's wavefront now (see :func:`wavefront`); ``()`` when there is no
    process group, the recorder is off or empty, torch has no recorder to dump, or
    anything fails. Never raises."""
    try:
        c10d = _c10d()
        return () if c10d is None else _merged(_dump(c10d, True))
    except Exception:
        return ()
