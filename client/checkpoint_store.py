"""On-disk checkpoint store: layout, manifest, commit protocol, validation, quarantine, retention.

Standard library only (no torch, no numpy), so `rankguard checkpoints` works on a head node.

Layout of a checkpoint root ``ROOT``::

    ROOT/step-00000020.partial/          save in progress (or interrupted): the saver writes the
                                         DCP files (.metadata, __0_0.distcp, ...) and per-rank
                                         files (trainer-state-rank0.pt, ...) here
    ROOT/step-00000020/                  committed: only ever produced by commit(), an atomic
                                         rename of the .partial dir after manifest.json inside it
                                         is written and fsynced; the root is fsynced after it
    ROOT/quarantine/<name>.<UTC stamp>/  moved aside, never deleted, with QUARANTINE.json inside:
                                         {"reason", "state", "quarantined_at", "original", ...}

``manifest.json`` (format_version 1) lists every file of the step dir except itself::

    {"format": "rankguard-checkpoint", "format_version": 1, "step": 20, "world_size": 8,
     "created_at": 1700000000.0, "files": [{"path": "__0_0.distcp", "size": 4096,
     "sha256": "..."}], "extra": {...arbitrary JSON from the trainer...}}

States (``CheckpointStatus.state``):

- ``validated``: committed dir, manifest readable and well formed, every listed file present
  with its size (and, when checksums are verified, its sha256), no unlisted file.
- ``incomplete``: a ``.partial`` dir, or a committed dir whose manifest is missing,
  unreadable, not valid JSON, of another format/version, or names another step.
- ``corrupt``: a listed file is missing, has another size or checksum, or an unlisted file
  is present. The reason names the file, e.g. ``__1_0.distcp: size 1200 != manifest 4096
  (truncated)``.
- ``quarantined``: an entry under ``ROOT/quarantine/``; ``original_state`` is the state it was
  judged to have when it was moved aside.

Public API:

- ``STEP_DIR_RE``, ``step_dir_name(step)``, ``parse_step_dir_name(name)``.
- ``partial_dir(root, step) -> Path``: create ``ROOT/step-N.partial`` (one rank only, before
  the ranks write); a stale ``.partial`` of the same step (crashed run) is quarantined first;
  raises CheckpointError if ``step-N`` is already committed.
- ``hash_file(path, chunk=8 MiB, *, base=None, fsync=True) -> FileEntry``: each rank hashes
  (and fsyncs, making it durable) its own files; ``FileEntry.to_dict()/from_dict()`` carry the
  entries to rank 0 as JSON. ``entry.path`` is relative to ``base`` (default: the file name).
- ``hash_tree(directory, *, fsync=True) -> list[FileEntry]``: every file of a dir (one process).
- ``commit(partial, step, world_size, files, extra) -> Path``: check the listing against the
  dir (every file listed, every listed file present with its size), write manifest.json
  (tmp + fsync + rename), fsync the dir, rename ``.partial`` -> final, fsync the root.
  If it raises (CheckpointError, or OSError such as ENOSPC), nothing is committed: the
  ``.partial`` stays partial (a failed root fsync after the rename is rolled back).
- ``read_manifest(step_dir) -> Manifest`` (raises CheckpointError with the reason).
- ``inspect(step_dir, verify_checksums=True, progress=None) -> CheckpointStatus``.
- ``scan(root, verify_checksums=True, progress=None) -> list[CheckpointStatus]``: step dirs,
  partial dirs and quarantined entries, sorted by step; missing root -> ``[]``; unrelated
  names are ignored. Read-only.
- ``quarantine(status_or_path, reason, *, state=None) -> Path``: move aside + QUARANTINE.json.
- ``select_resume(root, progress=None) -> (CheckpointStatus | None, list[CheckpointStatus])``:
  rank 0 at every (re)start: quarantine every ``.partial``; verify committed dirs newest-first
  with checksums, quarantining each incomplete/corrupt one met; return the newest validated
  (or None) and the quarantined statuses (state "quarantined", new path, ``original_state``).
- ``apply_retention(root, keep) -> list[Path]``: delete validated committed checkpoints beyond
  the newest ``keep`` (size-only checks; ``keep <= 0`` keeps all). Never removes the newest
  validated one, never touches ``.partial`` dirs, invalid dirs or the quarantine.
- ``CheckpointError(Exception)``.

``progress`` callbacks are called as ``progress(bytes_hashed, bytes_total)``. In ``scan`` the
total is known up front; in ``select_resume`` it grows as older checkpoints need verifying.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_TMP_NAME = "manifest.json.tmp"
QUARANTINE_DIRNAME = "quarantine"
QUARANTINE_RECORD = "QUARANTINE.json"
FORMAT = "rankguard-checkpoint"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
DEFAULT_CHUNK = 8 * 1024 * 1024
_TRASH_PREFIX = ".trash-"

VALIDATED = "validated"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
QUARANTINED = "quarantined"
STATES = (VALIDATED, INCOMPLETE, CORRUPT, QUARANTINED)

#: ``step-00000020`` (committed) or ``step-00000020.partial``; group 1 = digits, 2 = suffix.
STEP_DIR_RE = re.compile(r"^step-(\d{8,})(\.partial)?$")
_QUARANTINE_ENTRY_RE = re.compile(r"^(step-\d{8,}(?:\.partial)?)\.")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_RESERVED = frozenset({MANIFEST_NAME, MANIFEST_TMP_NAME})

Progress = Callable[[int, int], None]


class CheckpointError(Exception):
    """A checkpoint operation was refused or a checkpoint cannot be used (message says why)."""


# --------------------------------------------------------------------------- names


def step_dir_name(step: int) -> str:
    """``step-%08d``: the committed directory name of ``step``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    return f"step-{step:08d}"


def parse_step_dir_name(name: str) -> tuple[int, bool] | None:
    """``(step, is_partial)`` for a canonical step dir name, else None."""
    m = STEP_DIR_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    if m.group(1) != f"{step:08d}":  # non-canonical (e.g. extra leading zeros): not ours
        return None
    return step, m.group(2) is not None


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the step dir (posix), size, sha256 hex."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: Any) -> FileEntry:
        """Parse and validate; raises CheckpointError naming the bad field."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"file entry must be an object, got {type(data).__name__}")
        path, size, digest = data.get("path"), data.get("size"), data.get("sha256")
        reason = _unsafe_path_reason(path)
        if reason:
            raise CheckpointError(f"path {path!r} {reason}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{path}: size must be a non-negative integer, got {size!r}")
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            raise CheckpointError(f"{path}: sha256 must be 64 lowercase hex digits")
        return cls(path=path, size=size, sha256=digest)


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    created_at: float
    files: tuple[FileEntry, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "files": [f.to_dict() for f in self.files],
            "extra": self.extra,
        }

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Parse and validate a decoded manifest; raises CheckpointError naming the problem."""
        if not isinstance(data, dict):
            raise CheckpointError(f"top level is {_json_type(data)}, expected an object")
        fmt = data.get("format")
        if fmt != FORMAT:
            raise CheckpointError(f"format is {_short(fmt)}, expected {FORMAT!r}")
        version = data.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version != FORMAT_VERSION:
            raise CheckpointError(
                f"unsupported format_version {_short(version)} (this rankguard reads {FORMAT_VERSION})"
            )
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"'step' must be a non-negative integer, got {_short(step)}")
        world_size = data.get("world_size")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise CheckpointError(
                f"'world_size' must be a positive integer, got {_short(world_size)}"
            )
        created_at = data.get("created_at")
        if (
            isinstance(created_at, bool)
            or not isinstance(created_at, (int, float))
            or not math.isfinite(created_at)
        ):
            raise CheckpointError(f"'created_at' must be a unix time, got {_short(created_at)}")
        raw_files = data.get("files")
        if not isinstance(raw_files, list):
            raise CheckpointError(f"'files' must be a list, got {_json_type(raw_files)}")
        files: list[FileEntry] = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_files):
            try:
                entry = FileEntry.from_dict(raw)
            except CheckpointError as e:
                raise CheckpointError(f"files[{i}]: {e}") from None
            if entry.path in seen:
                raise CheckpointError(f"files[{i}]: {entry.path} listed twice")
            seen.add(entry.path)
            files.append(entry)
        extra = data.get("extra", {})
        if not isinstance(extra, dict):
            raise CheckpointError(f"'extra' must be an object, got {_json_type(extra)}")
        return cls(
            step=step,
            world_size=world_size,
            created_at=float(created_at),
            files=tuple(files),
            extra=extra,
        )


@dataclass(frozen=True)
class CheckpointStatus:
    """What one checkpoint directory is. ``reason`` is "" when validated."""

    step: int
    path: Path
    state: str
    reason: str
    size_bytes: int
    world_size: int | None = None
    created_at: float | None = None
    extra: dict[str, Any] | None = None
    #: for quarantined entries: the state it had when moved aside ("incomplete"/"corrupt"/...).
    original_state: str | None = None

    @property
    def is_quarantined(self) -> bool:
        # step dirs have canonical names; quarantine entries carry a timestamp suffix
        return parse_step_dir_name(self.path.name) is None

    @property
    def is_partial(self) -> bool:
        parsed = parse_step_dir_name(self.path.name)
        return parsed is not None and parsed[1]

    @property
    def is_committed(self) -> bool:
        """A ``step-N`` dir at the root (whatever its state): it claims to be a checkpoint."""
        parsed = parse_step_dir_name(self.path.name)
        return parsed is not None and not parsed[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "state": self.state,
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "original_state": self.original_state,
            "extra": self.extra,
        }


# --------------------------------------------------------------------------- low-level I/O


def _fsync_dir(path: Path) -> None:
    """fsync a directory so renames/creations in it are durable. Filesystems that cannot
    fsync a directory (EINVAL/ENOTSUP) are tolerated; real failures (EIO, ENOSPC) raise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``path`` atomically: ``path.tmp`` + fsync + rename (caller fsyncs the dir).
    On any failure the tmp file is removed and ``path`` is untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644
        )
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _sha256_file(
    path: Path, chunk: int, *, fsync: bool = False, on_bytes: Callable[[int], None] | None = None
) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        if fsync:
            os.fsync(f.fileno())
        # no 8 MiB buffer for a 100-byte file; +1 so the first read can already see EOF
        buf = bytearray(max(1, min(chunk, os.fstat(f.fileno()).st_size + 1)))
        mv = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            size += n
            if on_bytes is not None:
                on_bytes(n)
    return size, h.hexdigest()


def _walk_files(directory: Path) -> dict[str, int]:
    """Every non-directory entry under ``directory`` as {relative posix path: size}."""
    out: dict[str, int] = {}

    def _raise(err: OSError) -> None:
        raise err

    for dirpath, _dirnames, filenames in os.walk(directory, onerror=_raise):
        rel_dir = Path(dirpath).relative_to(directory)
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            try:
                out[rel] = os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return out


def _tree_size(directory: Path) -> int:
    try:
        return sum(_walk_files(directory).values())
    except OSError:
        return 0


def _utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def _unsafe_path_reason(path: Any) -> str:
    if not isinstance(path, str) or not path:
        return "must be a non-empty string"
    if "\x00" in path or "\\" in path:
        return "contains a NUL or backslash"
    if path.startswith("/"):
        return "is absolute"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "is not a normalized relative path"
    if path in _RESERVED:
        return "is a reserved name"
    return ""


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number" if isinstance(v, (int, float)) else type(v).__name__
    )


def _short(v: Any, limit: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# --------------------------------------------------------------------------- write path


INCARNATION_FILE = "incarnation"


def claim_incarnation(root: str | os.PathLike[str], at_least: int = 0) -> int:
    """The job's next incarnation number, kept in `root/incarnation` (the shared checkpoint
    directory): rank 0 of each start claims one. torchrun's restart count is per node and
    does not count membership changes, so on several nodes it is neither the same
    everywhere nor always growing; this number is both. Raises OSError when the
    directory cannot be written (the caller falls back to the restart count)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / INCARNATION_FILE
    try:
        current = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        current = 0  # a first start, or a damaged file: the restart count still bounds it
    value = max(current, at_least)
    data = f"{value + 1}\n".encode()
    try:
        _write_durably(path, data)
    except OSError as exc:
        if exc.errno != errno.ENOSPC or not path.is_file():
            raise
        # A full disk: a new file gets no block, but the file's own block takes these few
        # bytes. Without this, a restart while the disk is full fell back to the restart
        # count and could reuse an earlier incarnation's number (its incidents' keys).
        _overwrite_in_place(path, data)
    _fsync_dir(root)
    return value


def _overwrite_in_place(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Create and return ``ROOT/step-N.partial`` for a new save (call on one rank only).

    A stale ``.partial`` of the same step left by a crashed run is quarantined first.
    Raises CheckpointError if ``ROOT/step-N`` is already committed."""
    root = Path(root)
    name = step_dir_name(step)
    final = root / name
    if final.exists():
        raise CheckpointError(f"{final} is already committed; refusing to save step {step} again")
    root.mkdir(parents=True, exist_ok=True)
    partial = root / (name + PARTIAL_SUFFIX)
    if partial.exists():
        quarantine(partial, "stale .partial left by an interrupted save", state=INCOMPLETE)
    partial.mkdir()
    _fsync_dir(root)
    return partial


def hash_file(
    path: str | os.PathLike[str],
    chunk: int = DEFAULT_CHUNK,
    *,
    base: str | os.PathLike[str] | None = None,
    fsync: bool = True,
) -> FileEntry:
    """Hash one file for the manifest. ``entry.path`` is ``path`` relative to ``base`` (posix),
    or the file name without ``base``. With ``fsync`` (default) the file is fsynced first, so the
    rank that wrote it makes its data durable before it is committed."""
    path = Path(path)
    rel = path.relative_to(base).as_posix() if base is not None else path.name
    reason = _unsafe_path_reason(rel)
    if reason:
        raise CheckpointError(f"cannot list {path} in a manifest: {rel!r} {reason}")
    size, digest = _sha256_file(path, chunk, fsync=fsync)
    return FileEntry(path=rel, size=size, sha256=digest)


def hash_tree(
    directory: str | os.PathLike[str], *, chunk: int = DEFAULT_CHUNK, fsync: bool = True
) -> list[FileEntry]:
    """FileEntry for every file under ``directory`` except the manifest (single-process saves)."""
    directory = Path(directory)
    return [
        hash_file(directory / rel, chunk, base=directory, fsync=fsync)
        for rel in sorted(_walk_files(directory))
        if rel not in _RESERVED
    ]


def commit(
    partial: str | os.PathLike[str],
    step: int,
    world_size: int,
    files: Iterable[FileEntry | Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Commit a finished ``.partial`` dir: manifest, fsync, atomic rename. Returns the final path.

    Raises CheckpointError (listing does not match the dir, bad arguments, already committed) or
    OSError (e.g. ENOSPC); in both cases nothing is committed and the ``.partial`` stays."""
    partial = Path(partial)
    name = step_dir_name(step)
    if partial.name != name + PARTIAL_SUFFIX:
        raise CheckpointError(f"{partial} is not the partial dir of step {step} ({name}.partial)")
    if not partial.is_dir():
        raise CheckpointError(f"{partial} does not exist or is not a directory")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be a positive integer, got {world_size!r}")
    root = partial.parent
    final = root / name
    if final.exists():
        raise CheckpointError(f"{final} already exists; refusing to overwrite a committed step")

    entries: list[FileEntry] = []
    for f in files:
        entries.append(f if isinstance(f, FileEntry) else FileEntry.from_dict(f))
    manifest = Manifest(
        step=step,
        world_size=world_size,
        created_at=time.time(),
        files=tuple(sorted(entries, key=lambda e: e.path)),
        extra=dict(extra or {}),
    )
    try:
        # Round-trip through the parser: the manifest we write is one we accept.
        data = json.dumps(manifest.to_dict(), indent=2).encode() + b"\n"
        Manifest.from_dict(json.loads(data))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot write manifest for step {step}: {e}") from None

    problems = _listing_problems(partial, manifest, ignore=_RESERVED)
    if problems:
        raise CheckpointError(f"cannot commit {partial.name}: " + _join(problems))

    # 1. manifest durable inside the still-partial dir; 2. the dir entry durable.
    _write_durably(partial / MANIFEST_NAME, data)
    _fsync_dir(partial)
    # 3. the commit point: atomic rename; 4. make the rename durable (or undo it).
    os.rename(partial, final)
    try:
        _fsync_dir(root)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(final, partial)
        raise
    return final


def _listing_problems(
    directory: Path, manifest: Manifest, *, ignore: Iterable[str] = (MANIFEST_NAME,)
) -> list[str]:
    """Size-only comparison of a dir with a manifest: missing/short/long/unlisted files."""
    problems: list[str] = []
    listed = {f.path for f in manifest.files}
    for entry in manifest.files:
        try:
            st = os.stat(directory / entry.path)
        except FileNotFoundError:
            problems.append(f"{entry.path}: missing (listed in manifest, {entry.size} bytes)")
            continue
        except OSError as e:
            problems.append(f"{entry.path}: cannot stat: {e.strerror or e}")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{entry.path}: not a regular file")
        elif st.st_size != entry.size:
            how = "truncated" if st.st_size < entry.size else "larger than manifest"
            problems.append(f"{entry.path}: size {st.st_size} != manifest {entry.size} ({how})")
    ignored = set(ignore)
    for rel in sorted(_walk_files(directory)):
        if rel not in listed and rel not in ignored:
            problems.append(f"{rel}: not listed in manifest (unexpected file)")
    return problems


def _join(problems: list[str], limit: int = 3) -> str:
    s = "; ".join(problems[:limit])
    if len(problems) > limit:
        s += f" (+{len(problems) - limit} more)"
    return s


# --------------------------------------------------------------------------- read path


def read_manifest(step_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``step_dir/manifest.json``; CheckpointError says what is wrong."""
    p = Path(step_dir) / MANIFEST_NAME
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST_NAME} missing") from None
    except OSError as e:
        raise CheckpointError(f"{MANIFEST_NAME} unreadable: {e.strerror or e}") from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{MANIFEST_NAME} is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{MANIFEST_NAME} is not valid JSON: {_short(msg, 120)}") from None
    try:
        return Manifest.from_dict(data)
    except CheckpointError as e:
        raise CheckpointError(f"{MANIFEST_NAME}: {e}") from None


def inspect(
    step_dir: str | os.PathLike[str],
    verify_checksums: bool = True,
    progress: Progress | None = None,
) -> CheckpointStatus:
    """Judge one step dir, ``.partial`` dir or quarantine entry. Never raises for bad contents;
    raises CheckpointError only if ``step_dir`` is not a directory with a checkpoint name."""
    status, _ = _inspect(Path(step_dir), verify_checksums, progress)
    return status


def _inspect(
    path: Path, verify: bool, progress: Progress | None
) -> tuple[CheckpointStatus, Manifest | None]:
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist or is not a directory")
    parsed = parse_step_dir_name(path.name)
    if parsed is None:
        if path.parent.name == QUARANTINE_DIRNAME and _QUARANTINE_ENTRY_RE.match(path.name):
            return _inspect_quarantined(path), None
        raise CheckpointError(f"{path.name!r} is not a checkpoint directory name (step-NNNNNNNN)")
    step, is_partial = parsed
    size = _tree_size(path)

    def status(state: str, reason: str, m: Manifest | None) -> CheckpointStatus:
        return CheckpointStatus(
            step=step,
            path=path,
            state=state,
            reason=reason,
            size_bytes=size,
            world_size=m.world_size if m else None,
            created_at=m.created_at if m else None,
            extra=m.extra if m else None,
        )

    if is_partial:
        m = _try_manifest(path)
        why = "save in progress or interrupted (.partial directory)"
        if m is not None:
            why = "interrupted during commit (.partial directory with a manifest)"
        return status(INCOMPLETE, why, m), None
    try:
        m = read_manifest(path)
    except CheckpointError as e:
        return status(INCOMPLETE, str(e), None), None
    if m.step != step:
        return status(
            INCOMPLETE, f"{MANIFEST_NAME}: step {m.step} does not match directory {path.name}", m
        ), m
    try:
        problems = _listing_problems(path, m)
    except OSError as e:
        problems = [f"cannot list directory: {e.strerror or e}"]
    if problems:
        return status(CORRUPT, _join(problems), m), m
    if verify:
        problems = _checksum_problems(path, m, progress)
        if problems:
            return status(CORRUPT, _join(problems), m), m
    return status(VALIDATED, "", m), m


def _checksum_problems(path: Path, m: Manifest, progress: Progress | None) -> list[str]:
    total = m.total_bytes
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    problems = []
    for entry in m.files:
        before = done
        try:
            _size, digest = _sha256_file(path / entry.path, DEFAULT_CHUNK, on_bytes=on_bytes)
        except OSError as e:
            problems.append(f"{entry.path}: unreadable: {e.strerror or e}")
            digest = None
        # keep the byte count consistent with the total even if the file changed under us
        done = before + entry.size
        if digest is not None and digest != entry.sha256:
            problems.append(
                f"{entry.path}: sha256 mismatch (content changed): "
                f"manifest {entry.sha256[:12]}..., found {digest[:12]}..."
            )
    if progress is not None and total == 0:
        progress(0, 0)
    return problems


def _try_manifest(path: Path) -> Manifest | None:
    try:
        return read_manifest(path)
    except CheckpointError:
        return None


def _inspect_quarantined(path: Path) -> CheckpointStatus:
    record: dict[str, Any] = {}
    reason = ""
    try:
        loaded = json.loads((path / QUARANTINE_RECORD).read_bytes())
        if isinstance(loaded, dict):
            record = loaded
        else:
            reason = f"{QUARANTINE_RECORD} is not an object"
    except FileNotFoundError:
        reason = f"{QUARANTINE_RECORD} missing (quarantine interrupted?)"
    except (OSError, ValueError, RecursionError) as e:
        reason = f"{QUARANTINE_RECORD} unreadable: {_short(str(e), 80)}"
    original = record.get("original")
    parsed = parse_step_dir_name(original) if isinstance(original, str) else None
    if parsed is None:
        m = _QUARANTINE_ENTRY_RE.match(path.name)
        parsed = parse_step_dir_name(m.group(1)) if m else None
    if parsed is None:
        raise CheckpointError(f"{path.name!r} is not a quarantined checkpoint")
    if not reason:
        reason = str(record.get("reason", "")) or "quarantined (no reason recorded)"
    state = record.get("state")
    m = _try_manifest(path)
    return CheckpointStatus(
        step=parsed[0],
        path=path,
        state=QUARANTINED,
        reason=reason,
        size_bytes=_tree_size(path),
        world_size=m.world_size if m else None,
        created_at=m.created_at if m else None,
        extra=m.extra if m else None,
        original_state=state if isinstance(state, str) else None,
    )


def _entries(root: Path) -> tuple[list[tuple[int, Path]], list[tuple[int, Path]], list[Path]]:
    """(committed, partial) as (step, path) and quarantine entry paths, unsorted."""
    committed: list[tuple[int, Path]] = []
    partial: list[tuple[int, Path]] = []
    quarantined: list[Path] = []
    if not root.is_dir():
        if root.exists():
            raise CheckpointError(f"{root} is not a directory")
        return committed, partial, quarantined
    with os.scandir(root) as it:
        for e in it:
            if not e.is_dir(follow_symlinks=False):
                continue
            if e.name == QUARANTINE_DIRNAME:
                with os.scandir(e.path) as qit:
                    quarantined.extend(
                        Path(q.path)
                        for q in qit
                        if q.is_dir(follow_symlinks=False) and _QUARANTINE_ENTRY_RE.match(q.name)
                    )
                continue
            parsed = parse_step_dir_name(e.name)
            if parsed is not None:
                (partial if parsed[1] else committed).append((parsed[0], Path(e.path)))
    return committed, partial, quarantined


def _sort_key(s: CheckpointStatus) -> tuple[int, int, str]:
    kind = 0 if s.is_quarantined else 1 if s.is_partial else 2
    return s.step, kind, s.path.name


def scan(
    root: str | os.PathLike[str],
    verify_checksums: bool = True,
    progress: Progress | None = None,
) -> list[CheckpointStatus]:
    """Every step dir, partial dir and quarantined entry of ``root``, sorted by step
    (quarantined, then partial, then committed within a step). Read-only."""
    root = Path(root)
    committed, partial, quarantined = _entries(root)
    paths = [p for _, p in committed] + [p for _, p in partial] + quarantined
    results: list[tuple[CheckpointStatus, Manifest | None]] = []
    for p in paths:
        try:
            results.append(_inspect(p, False, None))
        except CheckpointError:  # vanished while scanning, or not ours after all
            continue
    if verify_checksums:
        to_hash = [(i, m) for i, (s, m) in enumerate(results) if s.state == VALIDATED and m]
        total = sum(m.total_bytes for _, m in to_hash)
        offset = 0
        for i, m in to_hash:
            base = offset

            def sub(done: int, _t: int, base: int = base) -> None:
                if progress is not None:
                    progress(base + done, total)

            status = results[i][0]
            with contextlib.suppress(CheckpointError):  # vanished meanwhile
                results[i] = _inspect(status.path, True, sub)
            offset += m.total_bytes
        if progress is not None and not to_hash:
            progress(0, 0)
    return sorted((s for s, _ in results), key=_sort_key)


# --------------------------------------------------------------------------- quarantine


def quarantine(
    status_or_path: CheckpointStatus | str | os.PathLike[str],
    reason: str,
    *,
    state: str | None = None,
) -> Path:
    """Move a checkpoint dir to ``ROOT/quarantine/<name>.<UTC stamp>/`` and write
    QUARANTINE.json there. Never deletes. ``state`` (recorded) defaults to the status's
    state, or a size-only ``inspect`` of the path. Returns the new path.

    Order: rename (atomic; nothing copied), fsync both dirs, then write the record. If the
    rename fails nothing moved; if the record cannot be written (ENOSPC) the entry is
    already aside and ``scan`` reports it as quarantined with "QUARANTINE.json missing"."""
    if isinstance(status_or_path, CheckpointStatus):
        path = status_or_path.path
        state = state or status_or_path.state
    else:
        path = Path(status_or_path)
    parsed = parse_step_dir_name(path.name)
    if parsed is None or not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (or is already quarantined)")
    if state is None:
        state = inspect(path, verify_checksums=False).state
    root = path.parent
    qdir = root / QUARANTINE_DIRNAME
    if not qdir.is_dir():
        qdir.mkdir(exist_ok=True)
        _fsync_dir(root)
    stamp = _utc_stamp()
    dest = qdir / f"{path.name}.{stamp}"
    n = 1
    while dest.exists():
        dest = qdir / f"{path.name}.{stamp}-{n}"
        n += 1
    os.rename(path, dest)
    _fsync_dir(qdir)
    _fsync_dir(root)
    record = {
        "format": "rankguard-quarantine",
        "format_version": 1,
        "reason": reason,
        "state": state,
        "quarantined_at": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
        "original": path.name,
        "original_path": str(path.absolute()),
        "step": parsed[0],
    }
    try:
        _write_durably(dest / QUARANTINE_RECORD, json.dumps(record, indent=2).encode() + b"\n")
        _fsync_dir(dest)
    except OSError as e:  # e.g. ENOSPC: the entry is aside already; scan says the record is missing
        log.warning("quarantined %s without its record (%s): %s", path.name, dest, e)
        return dest
    log.warning("quarantined checkpoint %s (%s: %s) -> %s", path.name, state, reason, dest)
    return dest


# --------------------------------------------------------------------------- resume, retention


def select_resume(
    root: str | os.PathLike[str], progress: Progress | None = None
) -> tuple[CheckpointStatus | None, list[CheckpointStatus]]:
    """Pick the checkpoint to resume from (rank 0, at every (re)start, with no save running).

    Every ``.partial`` is quarantined; committed dirs are verified newest-first with checksums,
    each incomplete/corrupt one met is quarantined with its reason, and the first validated one
    is returned (older ones are not read). Returns (newest validated or None, quarantined
    statuses with state "quarantined", their new path and ``original_state``)."""
    root = Path(root)
    committed, partial, _ = _entries(root)
    moved: list[CheckpointStatus] = []

    def put_aside(st: CheckpointStatus) -> None:
        try:
            dest = quarantine(st, st.reason)
        except OSError as e:  # no room even for the quarantine folder: leave it where it is
            log.warning("cannot quarantine %s (%s); left in place, never chosen", st.path.name, e)
            return
        moved.append(dataclasses.replace(st, path=dest, state=QUARANTINED, original_state=st.state))

    for _, p in sorted(partial):
        with contextlib.suppress(CheckpointError):  # vanished meanwhile
            put_aside(inspect(p, verify_checksums=False))

    hashed = 0
    for _, p in sorted(committed, reverse=True):
        base = hashed

        def sub(done: int, total: int, base: int = base) -> None:
            if progress is not None:
                progress(base + done, base + total)

        try:
            st, m = _inspect(p, True, sub)
        except CheckpointError:
            continue
        hashed += m.total_bytes if m else 0
        if st.state == VALIDATED:
            return st, moved
        put_aside(st)
    return None, moved


def quarantine_failed_saves(root: str | os.PathLike[str], before_step: int) -> list[Path]:
    """Quarantine every ``.partial`` of a step older than ``before_step``: called by the
    committer right after step ``before_step`` committed, when no older save can still be in
    flight, so they are saves that failed (a full disk, a crashed writer). A move that cannot
    be made now (no space for the quarantine folder) is tried again after the next commit."""
    _, partial, _ = _entries(Path(root))
    moved = []
    for step, p in sorted(partial):
        if step >= before_step:
            continue
        try:
            moved.append(quarantine(p, "save failed; a later step committed", state=INCOMPLETE))
        except (OSError, CheckpointError) as e:
            log.warning("cannot quarantine failed save %s yet: %s", p.name, e)
    return moved


def apply_retention(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete validated committed checkpoints beyond the newest ``keep`` (size-only checks).

    ``keep <= 0`` keeps everything. Never removes the newest validated checkpoint; never
    touches ``.partial`` dirs, invalid committed dirs (select_resume quarantines those) or the
    quarantine. A checkpoint is first renamed to a hidden ``.trash-*`` name (so a crash
    mid-delete never leaves a half-deleted ``step-N``), then removed. Returns removed paths."""
    root = Path(root)
    if keep <= 0 or not root.is_dir():
        return []
    _empty_trash(root)
    committed, _, _ = _entries(root)
    validated: list[Path] = []
    for _, p in sorted(committed, reverse=True):
        with contextlib.suppress(CheckpointError):
            if inspect(p, verify_checksums=False).state == VALIDATED:
                validated.append(p)
    removed: list[Path] = []
    for p in validated[keep:]:
        trash = root / f"{_TRASH_PREFIX}{p.name}.{_utc_stamp()}"
        os.rename(p, trash)
        _fsync_dir(root)
        removed.append(p)
        _rmtree(trash)
    return removed


def _empty_trash(root: Path) -> None:
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith(_TRASH_PREFIX) and e.is_dir(follow_symlinks=False):
                _rmtree(Path(e.path))


def _rmtree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except OSError as e:
        log.warning("could not remove %s (will retry at next retention): %s", path, e)
