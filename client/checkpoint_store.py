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
  is present, or anything in the dir is a symbolic link (refused, never followed), or, when
  a key is given, the manifest's HMAC is missing, of another key or wrong. The reason
  names the file, e.g. ``__1_0.distcp: size 1200 != manifest 4096 (truncated)``.
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
- ``apply_retention(root, keep, *, key, verified) -> list[Path]``: delete validated committed
  checkpoints beyond the newest ``keep`` fully verified ones (``keep <= 0`` keeps all);
  nothing while the newest committed one fails verification; only manifest-listed files.
- ``ensure_partial_dir(root, step)``: every rank's safe ``mkdir -p`` of ``step-N.partial``.
- ``identity(step_dir)``: ``(st_dev, st_ino)`` of a checkpoint the caller verified itself.
- ``load_key(path)``, ``resolve_key(key_file)`` (else ``$RANKGUARD_CHECKPOINT_KEY_FILE``),
  ``sign_manifest``, ``check_signature``: keyed manifests (HMAC-SHA256).
- ``DataUnpickler(file).load()``: a pickle read as data only (``weights_only=True``).
- ``CheckpointError(Exception)``, ``UntrustedManifest(CheckpointError)``.

Trust (docs/security.md, "Checkpoint roots"): nothing under a root is followed through a
symbolic link (directory descriptors opened ``O_NOFOLLOW``), atomic writes never write
through a planted tmp name, and ``key=`` (every read and write function takes one) makes a
tampered manifest corrupt before any file it lists is read. Without a key the SHA-256 sums
catch corruption, not tampering.

``progress`` callbacks are called as ``progress(bytes_hashed, bytes_total)``. In ``scan`` the
total is known up front; in ``select_resume`` it grows as older checkpoints need verifying.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import math
import os
import pickle
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..contract import crc
from ..contract.secrets import SecretFileError, read_secret_file

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
_TRASH_RE = re.compile(r"^\.trash-step-\d{8,}\.")
#: the manifest field holding its HMAC when a checkpoint key is configured
HMAC_FIELD = "hmac"
HMAC_ALG = "hmac-sha256"
#: where a checkpoint key file is named when no argument names one
KEY_FILE_ENV = "RANKGUARD_CHECKPOINT_KEY_FILE"
MIN_KEY_BYTES = 16
_MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # far above any real manifest, far below a memory problem
_MAX_SMALL_FILE = 1024 * 1024  # QUARANTINE.json, incarnation
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a listed name must not block the reader forever
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

VALIDATED = "validated"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
QUARANTINED = "quarantined"
STATES = (VALIDATED, INCOMPLETE, CORRUPT, QUARANTINED)

#: ``step-00000020`` (committed) or ``step-00000020.partial``; group 1 = digits, 2 = suffix.
STEP_DIR_RE = re.compile(r"^step-(\d{8,})(\.partial)?$")
_QUARANTINE_ENTRY_RE = re.compile(r"^(step-\d{8,}(?:\.partial)?)\.")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CRC32_RE = re.compile(r"^[0-9a-f]{8}$")
# File checksums. Without a key the checksum is there to catch corruption (a torn write, a
# flipped bit, a truncated copy), and CRC-32 does that at twice SHA-256's speed here (both
# release the GIL on large buffers). With a key, tampering is the threat: a forged file
# with the same CRC-32 is trivial, so keyed manifests list SHA-256 sums only.
SHA256, CRC32 = "sha256", "crc32"
CHECKSUMS = (SHA256, CRC32)


def checksum_for(key: bytes | None) -> str:
    """The checksum a new manifest uses: SHA-256 with a key (tamper-evident), else CRC-32."""
    return SHA256 if key is not None else CRC32


_RESERVED = frozenset({MANIFEST_NAME, MANIFEST_TMP_NAME})

Progress = Callable[[int, int], None]


class CheckpointError(Exception):
    """A checkpoint operation was refused or a checkpoint cannot be used (message says why)."""


class UntrustedManifest(CheckpointError):
    """A manifest whose HMAC is missing, of another key, or wrong while a key is configured:
    the checkpoint may have been tampered with, so it is judged corrupt and never loaded."""


# --------------------------------------------------------------------------- keys


def load_key(path: str | os.PathLike[str]) -> bytes:
    """The checkpoint key in ``path``: its bytes without trailing whitespace, at least
    ``MIN_KEY_BYTES`` long, in a regular file only its owner can read (like the agent token).
    Raises CheckpointError with a one-line reason."""
    try:
        return read_secret_file(path, "checkpoint key", MIN_KEY_BYTES, strip=bytes.rstrip)
    except SecretFileError as e:
        raise CheckpointError(str(e)) from None


def resolve_key(
    key_file: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """The key from ``key_file``, else from the file named by ``$RANKGUARD_CHECKPOINT_KEY_FILE``,
    else None (manifests then carry plain SHA-256 only: corruption is caught, tampering not)."""
    if key_file is None:
        key_file = (os.environ if environ is None else environ).get(KEY_FILE_ENV) or None
    return None if key_file is None else load_key(key_file)


def key_id(key: bytes) -> str:
    """A short public name of a key, so a mismatch can say "signed with another key"."""
    return hashlib.sha256(b"rankguard-checkpoint-key-id\0" + key).hexdigest()[:16]


def _signed_bytes(doc: Mapping[str, Any]) -> bytes:
    """The canonical bytes an HMAC covers: the manifest without its HMAC field."""
    body = {k: v for k, v in doc.items() if k != HMAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_manifest(doc: Mapping[str, Any], key: bytes) -> dict[str, Any]:
    """``doc`` with its HMAC field set."""
    digest = hmac.new(key, _signed_bytes(doc), hashlib.sha256).hexdigest()
    return {**doc, HMAC_FIELD: {"alg": HMAC_ALG, "key_id": key_id(key), "digest": digest}}


def check_signature(doc: Mapping[str, Any], key: bytes) -> None:
    """Raise UntrustedManifest unless ``doc`` carries a valid HMAC under ``key``."""
    seal = doc.get(HMAC_FIELD)
    if seal is None:
        raise UntrustedManifest(f"{MANIFEST_NAME} is not signed (a checkpoint key is configured)")
    if not isinstance(seal, Mapping) or seal.get("alg") != HMAC_ALG:
        raise UntrustedManifest(f"{MANIFEST_NAME}: '{HMAC_FIELD}' is not an {HMAC_ALG} seal")
    if seal.get("key_id") != key_id(key):
        raise UntrustedManifest(
            f"{MANIFEST_NAME} is signed with another key (key id {_short(seal.get('key_id'))}, "
            f"ours {key_id(key)})"
        )
    digest = seal.get("digest")
    expected = hmac.new(key, _signed_bytes(doc), hashlib.sha256).hexdigest()
    if not isinstance(digest, str) or not hmac.compare_digest(digest, expected):
        raise UntrustedManifest(f"{MANIFEST_NAME}: HMAC does not match (tampered with)")


# --------------------------------------------------------------------------- data-only pickles

#: What a data-only pickle may name: the standard library's part of the allowlist of
#: ``torch.load(weights_only=True)`` (torch/_weights_only_unpickler.py), plus frozenset
#: (protocols < 4 name it). Each builds data whatever its arguments: no code of the file's.
_DATA_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "Counter"): collections.Counter,
    ("_codecs", "encode"): codecs.encode,  # bytes, in protocols < 3
    ("builtins", "bytearray"): bytearray,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
}


class DataUnpickler(pickle.Unpickler):
    """Unpickles data only, as ``torch.load(weights_only=True)`` does: containers, strings,
    bytes and numbers. Any other global (a class or function: how a pickle runs code) is
    refused with ``pickle.UnpicklingError`` before it is called; so is a persistent id.
    Checkpoints (``state.pkl``) and tier-0 snapshots are read with it."""

    def find_class(self, module: str, name: str) -> Any:
        # protocols < 3 write Python 2's names (__builtin__.set): read them as pickle does
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = _DATA_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"{_short(f'{module}.{name}', 80)} is not allowed: data only (weights_only)"
            )
        return found


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
    """One file of a checkpoint: path relative to the step dir (posix), size, and its
    checksum: ``sha256`` (64 hex digits) or ``crc32`` (8 hex digits), at least one.
    Manifests written before CRC-32 carry ``sha256`` only; they verify as before."""

    path: str
    size: int
    sha256: str | None = None
    crc32: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size}
        if self.sha256 is not None:
            d["sha256"] = self.sha256
        if self.crc32 is not None:
            d["crc32"] = self.crc32
        return d

    @property
    def algorithm(self) -> str:
        """The checksum verification uses: the stronger one listed."""
        return SHA256 if self.sha256 is not None else CRC32

    @property
    def digest(self) -> str:
        return self.sha256 if self.sha256 is not None else self.crc32  # type: ignore[return-value]

    @classmethod
    def from_dict(cls, data: Any) -> FileEntry:
        """Parse and validate; raises CheckpointError naming the bad field."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"file entry must be an object, got {type(data).__name__}")
        path, size = data.get("path"), data.get("size")
        digest, crc = data.get("sha256"), data.get("crc32")
        reason = _unsafe_path_reason(path)
        if reason:
            raise CheckpointError(f"path {path!r} {reason}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{path}: size must be a non-negative integer, got {size!r}")
        if digest is None and crc is None:
            raise CheckpointError(f"{path}: no checksum (sha256 or crc32)")
        if digest is not None and (not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest)):
            raise CheckpointError(f"{path}: sha256 must be 64 lowercase hex digits")
        if crc is not None and (not isinstance(crc, str) or not _CRC32_RE.fullmatch(crc)):
            raise CheckpointError(f"{path}: crc32 must be 8 lowercase hex digits")
        return cls(path=path, size=size, sha256=digest, crc32=crc)


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
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


# Everything under a checkpoint root is reached through directory descriptors opened with
# O_NOFOLLOW, one component at a time: a symbolic link planted anywhere under the root (by
# anyone who can write there) is refused, never followed out of it. The root itself is
# opened as configured (it may be a symlink the operator chose).


def _open_dir_at(dir_fd: int | None, name: str) -> int:
    """Open directory ``name`` (relative to ``dir_fd``, or a path) without following a
    symlink in its last component; CheckpointError if it is a symlink or no directory."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        what = "is a symbolic link (refused)" if is_link else "is not a directory"
        raise CheckpointError(f"{name} {what}") from None


def _open_beneath(dir_fd: int, rel: str, flags: int = _READ_FLAGS, mode: int = 0o644) -> int:
    """Open ``rel`` (a normalized relative posix path) under ``dir_fd``, refusing a symlink
    in any component."""
    *parents, leaf = rel.split("/")
    fd = dir_fd
    try:
        for part in parents:
            nxt = _open_dir_at(fd, part)
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        try:
            return os.open(leaf, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{rel} is a symbolic link (refused)") from None
            raise
    finally:
        if fd != dir_fd:
            os.close(fd)


def _read_fd(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while True:
        block = os.read(fd, 1 << 20)
        if not block:
            return b"".join(chunks)
        total += len(block)
        if total > limit:
            raise CheckpointError(f"larger than {limit} bytes")
        chunks.append(block)


def _read_regular_at(dir_fd: int, name: str, limit: int) -> bytes:
    """The bytes of regular file ``name`` under ``dir_fd`` (no symlink, FIFO or device)."""
    fd = _open_beneath(dir_fd, name)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{name} is not a regular file")
        return _read_fd(fd, limit)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (see ``_write_durably_at``; the parent is opened as given)."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _write_durably_at(dir_fd, path.name, data)
    finally:
        os.close(dir_fd)


def _write_durably_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``name`` under ``dir_fd`` atomically: a fresh tmp file of an unguessable name
    (O_EXCL | O_NOFOLLOW: a planted ``name.tmp`` symlink is never written through) + fsync +
    rename, which replaces a symlink at ``name`` itself rather than its target (caller
    fsyncs the dir). On any failure the tmp file is removed and ``name`` is untouched."""
    tmp = f"{name}.tmp-{secrets.token_hex(6)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


class _Crc32:
    """hashlib's update/hexdigest over zlib.crc32 (which releases the GIL above 5 KiB)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = crc.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hasher(algorithm: str) -> Any:
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == CRC32:
        return _Crc32()
    raise CheckpointError(f"unknown checksum {algorithm!r} (one of {', '.join(CHECKSUMS)})")


def _sha256_fd(
    fd: int,
    chunk: int,
    on_bytes: Callable[[int], None] | None = None,
    algorithm: str = SHA256,
) -> tuple[int, str]:
    if algorithm == CRC32:  # a large file's parts on several cores (contract/crc.py)
        size, value = crc.crc32_fd(fd, chunk, on_bytes)
        return size, f"{value:08x}"
    h = _hasher(algorithm)
    size = 0
    # no 8 MiB buffer for a 100-byte file; +1 so the first read can already see EOF
    buf = bytearray(max(1, min(chunk, os.fstat(fd).st_size + 1)))
    mv = memoryview(buf)
    while True:
        n = os.readv(fd, [buf])
        if not n:
            break
        h.update(mv[:n])
        size += n
        if on_bytes is not None:
            on_bytes(n)
    return size, h.hexdigest()


def _sha256_file(
    path: Path,
    chunk: int,
    *,
    fsync: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    algorithm: str = SHA256,
) -> tuple[int, str]:
    fd = os.open(path, _READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path} is not a regular file")
        if fsync:
            os.fsync(fd)
        return _sha256_fd(fd, chunk, on_bytes, algorithm)
    finally:
        os.close(fd)


@dataclass
class _Tree:
    """Everything under a directory, by relative posix path, never following a symlink."""

    files: dict[str, int] = field(default_factory=dict)  # regular files: size
    links: list[str] = field(default_factory=list)  # symbolic links: refused
    others: list[str] = field(default_factory=list)  # FIFOs, sockets, devices
    dirs: list[str] = field(default_factory=list)  # subdirectories, parents first


def _read_tree(dir_fd: int, prefix: str = "", tree: _Tree | None = None) -> _Tree:
    tree = _Tree() if tree is None else tree
    with os.scandir(dir_fd) as it:
        entries = list(it)
    for e in entries:
        rel = prefix + e.name
        try:
            mode = e.stat(follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            tree.links.append(rel)
        elif stat.S_ISDIR(mode):
            try:
                sub = _open_dir_at(dir_fd, e.name)
            except CheckpointError:  # swapped for a symlink meanwhile
                tree.links.append(rel)
                continue
            except FileNotFoundError:
                continue
            tree.dirs.append(rel)
            try:
                _read_tree(sub, rel + "/", tree)
            finally:
                os.close(sub)
        elif stat.S_ISREG(mode):
            tree.files[rel] = e.stat(follow_symlinks=False).st_size
        else:
            tree.others.append(rel)
    return tree


def _walk_files(directory: Path) -> dict[str, int]:
    """Every regular file under ``directory`` as {relative posix path: size}."""
    fd = _open_dir_at(None, str(directory))
    try:
        return _read_tree(fd).files
    finally:
        os.close(fd)


def _tree_size(dir_fd: int) -> int:
    try:
        return sum(_read_tree(dir_fd).files.values())
    except (OSError, CheckpointError):
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
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            current = int(_read_regular_at(root_fd, INCARNATION_FILE, _MAX_SMALL_FILE).strip())
        except FileNotFoundError:
            current = 0  # a first start
        except (CheckpointError, ValueError):
            # damaged, or not a regular file (a planted symlink is replaced, never followed):
            # the restart count still bounds the number
            current = 0
        value = max(current, at_least)
        data = f"{value + 1}\n".encode()
        try:
            _write_durably_at(root_fd, INCARNATION_FILE, data)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            # A full disk: a new file gets no block, but the file's own block takes these
            # few bytes. Without this, a restart while the disk is full fell back to the
            # restart count and could reuse an earlier incarnation's number (its
            # incidents' keys).
            _overwrite_in_place_at(root_fd, INCARNATION_FILE, data)
        _fsync_fd(root_fd)
    finally:
        os.close(root_fd)
    return value


def _overwrite_in_place_at(dir_fd: int, name: str, data: bytes) -> None:
    """Rewrite a regular file's first bytes where it stands (never through a symlink)."""
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name}: not a regular file")
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
    if os.path.lexists(final):
        raise CheckpointError(f"{final} is already committed; refusing to save step {step} again")
    root.mkdir(parents=True, exist_ok=True)
    partial = root / (name + PARTIAL_SUFFIX)
    if os.path.lexists(partial):  # a symlink there is refused by quarantine(), never followed
        quarantine(partial, "stale .partial left by an interrupted save", state=INCOMPLETE)
    partial.mkdir()
    _fsync_dir(root)
    return partial


def ensure_partial_dir(root: str | os.PathLike[str], step: int) -> Path:
    """``ROOT/step-N.partial`` for a save every rank writes into (each rank calls it; the first
    creates it). Refuses (CheckpointError) a symlink or non-directory there, or a directory
    another user owns: its writers would otherwise write wherever it points."""
    root = Path(root)
    partial = root / (step_dir_name(step) + PARTIAL_SUFFIX)
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        partial.mkdir()
    st = os.lstat(partial)
    if not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise CheckpointError(f"{partial} is {what}; refusing to save into it")
    if st.st_uid != os.geteuid():
        raise CheckpointError(
            f"{partial} is owned by uid {st.st_uid}, not this process; refusing to save into it"
        )
    return partial


def hash_file(
    path: str | os.PathLike[str],
    chunk: int = DEFAULT_CHUNK,
    *,
    base: str | os.PathLike[str] | None = None,
    fsync: bool = True,
    algorithm: str = SHA256,
) -> FileEntry:
    """Hash one file for the manifest. ``entry.path`` is ``path`` relative to ``base`` (posix),
    or the file name without ``base``. With ``fsync`` (default) the file is fsynced first, so the
    rank that wrote it makes its data durable before it is committed. ``algorithm``: "sha256"
    (default) or "crc32" (``checksum_for(key)`` picks)."""
    path = Path(path)
    rel = path.relative_to(base).as_posix() if base is not None else path.name
    reason = _unsafe_path_reason(rel)
    if reason:
        raise CheckpointError(f"cannot list {path} in a manifest: {rel!r} {reason}")
    size, digest = _sha256_file(path, chunk, fsync=fsync, algorithm=algorithm)
    if algorithm == SHA256:
        return FileEntry(path=rel, size=size, sha256=digest)
    return FileEntry(path=rel, size=size, crc32=digest)


def hash_tree(
    directory: str | os.PathLike[str],
    *,
    chunk: int = DEFAULT_CHUNK,
    fsync: bool = True,
    algorithm: str = SHA256,
) -> list[FileEntry]:
    """FileEntry for every file under ``directory`` except the manifest (single-process saves)."""
    directory = Path(directory)
    return [
        hash_file(directory / rel, chunk, base=directory, fsync=fsync, algorithm=algorithm)
        for rel in sorted(_walk_files(directory))
        if rel not in _RESERVED
    ]


def commit(
    partial: str | os.PathLike[str],
    step: int,
    world_size: int,
    files: Iterable[FileEntry | Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
    *,
    key: bytes | None = None,
) -> Path:
    """Commit a finished ``.partial`` dir: manifest, fsync, atomic rename. Returns the final path.
    With ``key`` the manifest carries its HMAC (``check_signature``).

    Raises CheckpointError (listing does not match the dir, bad arguments, already committed) or
    OSError (e.g. ENOSPC); in both cases nothing is committed and the ``.partial`` stays."""
    partial = Path(partial)
    name = step_dir_name(step)
    if partial.name != name + PARTIAL_SUFFIX:
        raise CheckpointError(f"{partial} is not the partial dir of step {step} ({name}.partial)")
    if not stat.S_ISDIR(_lstat_mode(partial)):
        raise CheckpointError(f"{partial} does not exist or is not a directory (or is a symlink)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be a positive integer, got {world_size!r}")
    root = partial.parent
    final = root / name
    if os.path.lexists(final):
        raise CheckpointError(f"{final} already exists; refusing to overwrite a committed step")

    entries: list[FileEntry] = []
    for f in files:
        entries.append(f if isinstance(f, FileEntry) else FileEntry.from_dict(f))
    if key is not None and any(e.sha256 is None for e in entries):
        raise CheckpointError("a keyed manifest lists SHA-256 sums only (CRC-32 is forgeable)")
    manifest = Manifest(
        step=step,
        world_size=world_size,
        created_at=time.time(),
        files=tuple(sorted(entries, key=lambda e: e.path)),
        extra=dict(extra or {}),
    )
    try:
        # Round-trip through the parser: the manifest we write is one we accept.
        doc = manifest.to_dict() if key is None else sign_manifest(manifest.to_dict(), key)
        data = json.dumps(doc, indent=2).encode() + b"\n"
        Manifest.from_dict(json.loads(data))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot write manifest for step {step}: {e}") from None

    fd = _open_dir_at(None, str(partial))
    try:
        problems = _listing_problems(fd, manifest, ignore=_RESERVED)
    finally:
        os.close(fd)
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


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _listing_problems(
    dir_fd: int, manifest: Manifest, *, ignore: Iterable[str] = (MANIFEST_NAME,)
) -> list[str]:
    """Size-only comparison of a dir with a manifest: missing/short/long/unlisted files, and
    any symbolic link (listed or not: one could lead out of the root) or special file."""
    tree = _read_tree(dir_fd)
    links, others = set(tree.links), set(tree.others)
    problems: list[str] = []
    listed = {f.path for f in manifest.files}
    for entry in manifest.files:
        size = tree.files.get(entry.path)
        if entry.path in links:
            problems.append(f"{entry.path}: symbolic link (refused)")
        elif entry.path in others:
            problems.append(f"{entry.path}: not a regular file")
        elif size is None:
            problems.append(f"{entry.path}: missing (listed in manifest, {entry.size} bytes)")
        elif size != entry.size:
            how = "truncated" if size < entry.size else "larger than manifest"
            problems.append(f"{entry.path}: size {size} != manifest {entry.size} ({how})")
    ignored = set(ignore)
    for rel in sorted(links - listed):
        problems.append(f"{rel}: symbolic link (refused)")
    for rel in sorted((set(tree.files) | others) - listed - ignored):
        problems.append(f"{rel}: not listed in manifest (unexpected file)")
    return problems


def _join(problems: list[str], limit: int = 3) -> str:
    s = "; ".join(problems[:limit])
    if len(problems) > limit:
        s += f" (+{len(problems) - limit} more)"
    return s


# --------------------------------------------------------------------------- read path


def read_manifest(step_dir: str | os.PathLike[str], *, key: bytes | None = None) -> Manifest:
    """Read and validate ``step_dir/manifest.json``; CheckpointError says what is wrong.
    With ``key`` its HMAC is checked first (UntrustedManifest when missing or wrong)."""
    try:
        fd = _open_dir_at(None, str(step_dir))
    except OSError as e:
        raise CheckpointError(f"{MANIFEST_NAME} unreadable: {e.strerror or e}") from None
    try:
        return _read_manifest_at(fd, key)
    finally:
        os.close(fd)


def _read_manifest_at(dir_fd: int, key: bytes | None) -> Manifest:
    try:
        raw = _read_regular_at(dir_fd, MANIFEST_NAME, _MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST_NAME} missing") from None
    except OSError as e:
        raise CheckpointError(f"{MANIFEST_NAME} unreadable: {e.strerror or e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{MANIFEST_NAME} unreadable: {e}") from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{MANIFEST_NAME} is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{MANIFEST_NAME} is not valid JSON: {_short(msg, 120)}") from None
    if key is not None:
        if not isinstance(data, dict):
            raise UntrustedManifest(f"{MANIFEST_NAME} is not signed (not an object)")
        try:
            check_signature(data, key)
        except (TypeError, ValueError, RecursionError):  # unserializable: cannot be ours
            raise UntrustedManifest(
                f"{MANIFEST_NAME}: HMAC does not match (tampered with)"
            ) from None
    try:
        m = Manifest.from_dict(data)
    except CheckpointError as e:
        raise CheckpointError(f"{MANIFEST_NAME}: {e}") from None
    if key is not None:
        weak = [f.path for f in m.files if f.sha256 is None]
        if weak:  # we never sign such a manifest: CRC-32 would let a file be swapped
            raise UntrustedManifest(f"{MANIFEST_NAME}: {weak[0]} has no SHA-256 sum (keyed)")
    return m


def inspect(
    step_dir: str | os.PathLike[str],
    verify_checksums: bool = True,
    progress: Progress | None = None,
    *,
    key: bytes | None = None,
) -> CheckpointStatus:
    """Judge one step dir, ``.partial`` dir or quarantine entry. Never raises for bad contents;
    raises CheckpointError only if ``step_dir`` is not a directory with a checkpoint name
    (a symlink is refused). With ``key`` a manifest without a valid HMAC is corrupt."""
    status, _ = _inspect(Path(step_dir), verify_checksums, progress, key)
    return status


def _inspect(
    path: Path, verify: bool, progress: Progress | None, key: bytes | None = None
) -> tuple[CheckpointStatus, Manifest | None]:
    try:
        fd = _open_dir_at(None, str(path))  # CheckpointError for a symlink
    except OSError:
        raise CheckpointError(f"{path} does not exist or is not a directory") from None
    try:
        return _inspect_at(fd, path, verify, progress, key)
    finally:
        os.close(fd)


def _inspect_at(
    fd: int, path: Path, verify: bool, progress: Progress | None, key: bytes | None
) -> tuple[CheckpointStatus, Manifest | None]:
    parsed = parse_step_dir_name(path.name)
    if parsed is None:
        if path.parent.name == QUARANTINE_DIRNAME and _QUARANTINE_ENTRY_RE.match(path.name):
            return _inspect_quarantined(fd, path, key), None
        raise CheckpointError(f"{path.name!r} is not a checkpoint directory name (step-NNNNNNNN)")
    step, is_partial = parsed
    size = _tree_size(fd)

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
        m = _try_manifest(fd, key)
        why = "save in progress or interrupted (.partial directory)"
        if m is not None:
            why = "interrupted during commit (.partial directory with a manifest)"
        return status(INCOMPLETE, why, m), None
    try:
        m = _read_manifest_at(fd, key)
    except UntrustedManifest as e:
        return status(CORRUPT, str(e), None), None
    except CheckpointError as e:
        return status(INCOMPLETE, str(e), None), None
    if m.step != step:
        return status(
            INCOMPLETE, f"{MANIFEST_NAME}: step {m.step} does not match directory {path.name}", m
        ), m
    try:
        problems = _listing_problems(fd, m)
    except (OSError, CheckpointError) as e:
        problems = [f"cannot list directory: {getattr(e, 'strerror', None) or e}"]
    if problems:
        return status(CORRUPT, _join(problems), m), m
    if verify:
        problems = _checksum_problems(fd, m, progress)
        if problems:
            return status(CORRUPT, _join(problems), m), m
    return status(VALIDATED, "", m), m


def _checksum_problems(dir_fd: int, m: Manifest, progress: Progress | None) -> list[str]:
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
        digest = None
        try:
            fd = _open_beneath(dir_fd, entry.path)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    _size, digest = _sha256_fd(fd, DEFAULT_CHUNK, on_bytes, entry.algorithm)
                else:
                    problems.append(f"{entry.path}: not a regular file")
            finally:
                os.close(fd)
        except OSError as e:
            problems.append(f"{entry.path}: unreadable: {e.strerror or e}")
        except CheckpointError as e:
            problems.append(str(e))
        # keep the byte count consistent with the total even if the file changed under us
        done = before + entry.size
        if digest is not None and digest != entry.digest:
            problems.append(
                f"{entry.path}: {entry.algorithm} mismatch (content changed): "
                f"manifest {entry.digest[:12]}..., found {digest[:12]}..."
            )
    if progress is not None and total == 0:
        progress(0, 0)
    return problems


def _try_manifest(dir_fd: int, key: bytes | None) -> Manifest | None:
    try:
        return _read_manifest_at(dir_fd, key)
    except CheckpointError:
        return None


def _inspect_quarantined(fd: int, path: Path, key: bytes | None) -> CheckpointStatus:
    record: dict[str, Any] = {}
    reason = ""
    try:
        loaded = json.loads(_read_regular_at(fd, QUARANTINE_RECORD, _MAX_SMALL_FILE))
        if isinstance(loaded, dict):
            record = loaded
        else:
            reason = f"{QUARANTINE_RECORD} is not an object"
    except FileNotFoundError:
        reason = f"{QUARANTINE_RECORD} missing (quarantine interrupted?)"
    except (OSError, ValueError, RecursionError, CheckpointError) as e:
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
    m = _try_manifest(fd, key)
    return CheckpointStatus(
        step=parsed[0],
        path=path,
        state=QUARANTINED,
        reason=reason,
        size_bytes=_tree_size(fd),
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
    *,
    key: bytes | None = None,
) -> list[CheckpointStatus]:
    """Every step dir, partial dir and quarantined entry of ``root``, sorted by step
    (quarantined, then partial, then committed within a step). Read-only."""
    root = Path(root)
    committed, partial, quarantined = _entries(root)
    paths = [p for _, p in committed] + [p for _, p in partial] + quarantined
    results: list[tuple[CheckpointStatus, Manifest | None]] = []
    for p in paths:
        try:
            results.append(_inspect(p, False, None, key))
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
                results[i] = _inspect(status.path, True, sub, key)
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
    key: bytes | None = None,
) -> Path:
    """Move a checkpoint dir to ``ROOT/quarantine/<name>.<UTC stamp>/`` and write
    QUARANTINE.json there. Never deletes. ``state`` (recorded) defaults to the status's
    state, or a size-only ``inspect`` of the path. Returns the new path.

    A symlink at the checkpoint's name or at ``quarantine`` is refused (CheckpointError):
    the move goes through directory descriptors opened without following links, so nothing
    is ever moved out of the root.

    Order: rename (atomic; nothing copied), fsync both dirs, then write the record. If the
    rename fails nothing moved; if the record cannot be written (ENOSPC) the entry is
    already aside and ``scan`` reports it as quarantined with "QUARANTINE.json missing"."""
    if isinstance(status_or_path, CheckpointStatus):
        path = status_or_path.path
        state = state or status_or_path.state
    else:
        path = Path(status_or_path)
    parsed = parse_step_dir_name(path.name)
    if parsed is None:
        raise CheckpointError(f"{path} is not a checkpoint directory (or is already quarantined)")
    root = path.parent
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        mode = _lstat_mode_at(root_fd, path.name)
        if stat.S_ISLNK(mode):
            raise CheckpointError(f"{path} is a symbolic link (refused)")
        if not stat.S_ISDIR(mode):
            raise CheckpointError(f"{path} is not a checkpoint directory")
        if state is None:
            state = inspect(path, verify_checksums=False, key=key).state
        return _quarantine_at(root_fd, path, parsed[0], reason, state)
    finally:
        os.close(root_fd)


def _lstat_mode_at(dir_fd: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return 0


def _quarantine_at(root_fd: int, path: Path, step: int, reason: str, state: str) -> Path:
    created = False
    try:
        os.mkdir(QUARANTINE_DIRNAME, 0o755, dir_fd=root_fd)
        created = True
    except FileExistsError:
        pass
    q_fd = _open_dir_at(root_fd, QUARANTINE_DIRNAME)  # refuses a planted symlink
    try:
        if created:
            _fsync_fd(root_fd)
        stamp = _utc_stamp()
        dest_name = f"{path.name}.{stamp}"
        n = 1
        while _lstat_mode_at(q_fd, dest_name):
            dest_name = f"{path.name}.{stamp}-{n}"
            n += 1
        os.rename(path.name, dest_name, src_dir_fd=root_fd, dst_dir_fd=q_fd)
        _fsync_fd(q_fd)
        _fsync_fd(root_fd)
        dest = path.parent / QUARANTINE_DIRNAME / dest_name
        record = {
            "format": "rankguard-quarantine",
            "format_version": 1,
            "reason": reason,
            "state": state,
            "quarantined_at": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
            "original": path.name,
            "original_path": str(path.absolute()),
            "step": step,
        }
        try:
            dest_fd = _open_dir_at(q_fd, dest_name)
            try:
                data = json.dumps(record, indent=2).encode() + b"\n"
                _write_durably_at(dest_fd, QUARANTINE_RECORD, data)
                _fsync_fd(dest_fd)
            finally:
                os.close(dest_fd)
        except (OSError, CheckpointError) as e:
            # e.g. ENOSPC: the entry is aside already; scan says the record is missing
            log.warning("quarantined %s without its record (%s): %s", path.name, dest, e)
            return dest
    finally:
        os.close(q_fd)
    log.warning("quarantined checkpoint %s (%s: %s) -> %s", path.name, state, reason, dest)
    return dest


# --------------------------------------------------------------------------- resume, retention


def select_resume(
    root: str | os.PathLike[str], progress: Progress | None = None, *, key: bytes | None = None
) -> tuple[CheckpointStatus | None, list[CheckpointStatus]]:
    """Pick the checkpoint to resume from (rank 0, at every (re)start, with no save running).

    Every ``.partial`` is quarantined; committed dirs are verified newest-first with checksums
    (and, with ``key``, their manifest's HMAC, before any of their files is read), each
    incomplete/corrupt one met is quarantined with its reason, and the first validated one
    is returned (older ones are not read). Returns (newest validated or None, quarantined
    statuses with state "quarantined", their new path and ``original_state``)."""
    root = Path(root)
    committed, partial, _ = _entries(root)
    moved: list[CheckpointStatus] = []

    def put_aside(st: CheckpointStatus) -> None:
        try:
            dest = quarantine(st, st.reason, key=key)
        except (OSError, CheckpointError) as e:
            # no room even for the quarantine folder, or a symlink planted at its name
            log.warning("cannot quarantine %s (%s); left in place, never chosen", st.path.name, e)
            return
        moved.append(dataclasses.replace(st, path=dest, state=QUARANTINED, original_state=st.state))

    for _, p in sorted(partial):
        with contextlib.suppress(CheckpointError):  # vanished meanwhile
            put_aside(inspect(p, verify_checksums=False, key=key))

    hashed = 0
    for _, p in sorted(committed, reverse=True):
        base = hashed

        def sub(done: int, total: int, base: int = base) -> None:
            if progress is not None:
                progress(base + done, base + total)

        try:
            st, m = _inspect(p, True, sub, key)
        except CheckpointError:
            continue
        hashed += m.total_bytes if m else 0
        if st.state == VALIDATED:
            return st, moved
        put_aside(st)
    return None, moved


def quarantine_failed_saves(
    root: str | os.PathLike[str], before_step: int, *, key: bytes | None = None
) -> list[Path]:
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
            moved.append(
                quarantine(p, "save failed; a later step committed", state=INCOMPLETE, key=key)
            )
        except (OSError, CheckpointError) as e:
            log.warning("cannot quarantine failed save %s yet: %s", p.name, e)
    return moved


def identity(step_dir: str | os.PathLike[str]) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of a step dir: how a caller names a checkpoint it has verified
    itself (it hashed the files it committed), so retention need not read it again."""
    st = os.lstat(step_dir)
    return st.st_dev, st.st_ino


def apply_retention(
    root: str | os.PathLike[str],
    keep: int,
    *,
    key: bytes | None = None,
    verified: Collection[tuple[int, int]] = (),
) -> list[Path]:
    """Delete validated committed checkpoints beyond the newest ``keep`` verified ones.

    ``keep <= 0`` keeps everything. Only ``step-N`` directories are ever deleted, and in them
    only the files their manifest lists (then the manifest, then the emptied directories):
    a file nobody listed stays, and so does its directory. Nothing is deleted while the
    newest committed checkpoint fails verification (checksums, and the HMAC with ``key``):
    the older ones are then the only good ones. The ``keep`` checkpoints kept must pass
    full verification; those named in ``verified`` (``identity()`` of checkpoints the
    caller committed or verified itself) are not read again. Never touches ``.partial``
    dirs, invalid committed dirs (select_resume quarantines those) or the quarantine.
    A checkpoint is first renamed to a hidden ``.trash-step-N.*`` name (so a crash
    mid-delete never leaves a half-deleted ``step-N``), then removed. Returns removed paths."""
    root = Path(root)
    if keep <= 0 or not root.is_dir():
        return []
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _empty_trash(root_fd, key)
        doomed = _retention_victims(root, keep, key, set(verified))
        removed: list[Path] = []
        for p in doomed:
            trash = f"{_TRASH_PREFIX}{p.name}.{_utc_stamp()}"
            os.rename(p.name, trash, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            _fsync_fd(root_fd)
            removed.append(p)
            _delete_checkpoint(root_fd, trash, key)
        return removed
    finally:
        os.close(root_fd)


def _retention_victims(
    root: Path, keep: int, key: bytes | None, verified: set[tuple[int, int]]
) -> list[Path]:
    committed, _, _ = _entries(root)
    kept = 0
    doomed: list[Path] = []
    for i, (_, p) in enumerate(sorted(committed, reverse=True)):
        try:
            status = inspect(p, verify_checksums=False, key=key)
            if status.state == VALIDATED and kept < keep and identity(p) not in verified:
                status = inspect(p, verify_checksums=True, key=key)
        except (OSError, CheckpointError):  # vanished meanwhile
            continue
        if status.state != VALIDATED:
            if i == 0:
                log.warning(
                    "retention under %s deletes nothing: the newest checkpoint %s is %s (%s)",
                    root, p.name, status.state, status.reason,
                )  # fmt: skip
                return []
            continue
        if kept < keep:
            kept += 1
        else:
            doomed.append(p)
    return doomed


def _empty_trash(root_fd: int, key: bytes | None) -> None:
    """Finish deletions a crash interrupted (only ``.trash-step-N.*`` dirs, as above)."""
    with os.scandir(root_fd) as it:
        names = [e.name for e in it if _TRASH_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
    for name in names:
        _delete_checkpoint(root_fd, name, key)


def _delete_checkpoint(root_fd: int, name: str, key: bytes | None) -> None:
    """Delete the files the manifest of ``root/name`` lists, the manifest, then the emptied
    directories and ``name`` itself; anything else is left (with a warning)."""
    try:
        fd = _open_dir_at(root_fd, name)
    except (OSError, CheckpointError) as e:
        log.warning("not deleting %s: %s", name, e)
        return
    try:
        try:
            listed = [f.path for f in _read_manifest_at(fd, key).files]
        except CheckpointError:  # an interrupted delete removed the manifest last: no files left
            listed = []
        for rel in listed:
            with contextlib.suppress(FileNotFoundError, CheckpointError):
                _unlink_beneath(fd, rel)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(MANIFEST_NAME, dir_fd=fd)
        parents = {
            "/".join(rel.split("/")[:i]) for rel in listed for i in range(1, rel.count("/") + 1)
        }
        for sub in sorted(parents, key=lambda d: d.count("/"), reverse=True):
            with contextlib.suppress(OSError, CheckpointError):
                _rmdir_beneath(fd, sub)
    except OSError as e:
        log.warning("could not remove %s (will retry at next retention): %s", name, e)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=root_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("left %s: it holds files no manifest lists, or %s", name, e.strerror or e)


def _unlink_beneath(dir_fd: int, rel: str) -> None:
    *parents, leaf = rel.split("/")
    if not parents:
        os.unlink(leaf, dir_fd=dir_fd)  # a symlink itself is removed, never its target
        return
    sub = _open_beneath(dir_fd, "/".join(parents), _DIR_FLAGS)
    try:
        os.unlink(leaf, dir_fd=sub)
    finally:
        os.close(sub)


def _rmdir_beneath(dir_fd: int, rel: str) -> None:
    *parents, leaf = rel.split("/")
    if not parents:
        os.rmdir(leaf, dir_fd=dir_fd)
        return
    sub = _open_beneath(dir_fd, "/".join(parents), _DIR_FLAGS)
    try:
        os.rmdir(leaf, dir_fd=sub)
    finally:
        os.close(sub)


# --------------------------------------------------------------------------- tier 2: backup
#
# A backup root has the same layout as a checkpoint root: ``BACKUP/step-N`` is committed only
# by ``backup_checkpoint`` after every file was copied, fsynced and read back against the
# source's manifest; the manifest (its HMAC included) is copied byte for byte last. So every
# read function above (scan, inspect, select_resume, apply_retention, quarantine) works on it.

BACKUP_STATUS_NAME = "backup-status.json"  # in the *disk* root: a full backup target can't hold it
TIER_DISK, TIER_BACKUP = "disk", "backup"


class BackupSuperseded(CheckpointError):
    """The source checkpoint went away (retention) before it could be copied: not a fault."""


def backup_checkpoint(
    src: str | os.PathLike[str],
    backup_root: str | os.PathLike[str],
    *,
    key: bytes | None = None,
    keep: int = 0,
    chunk: int = DEFAULT_CHUNK,
) -> Path:
    """Copy validated checkpoint ``src`` to ``backup_root/step-N``; returns the copy's path.

    The bytes read from ``src`` are checked against its manifest while they are copied (a
    corrupt source is never backed up), the copy is fsynced, dropped from the page cache and
    read back against the manifest before the atomic rename commits it. On an I/O error
    (ENOSPC, EIO) our own ``.partial`` copy is removed (the source is intact on tier 1, and a
    leftover would keep a full target full); a copy that reads back wrong is quarantined.
    Then ``keep`` retention (``apply_retention``) and failed-copy quarantine run on the
    backup root. Raises CheckpointError / OSError; BackupSuperseded when ``src`` vanished."""
    src, backup_root = Path(src), Path(backup_root)
    try:
        src_fd = _open_dir_at(None, str(src))
    except FileNotFoundError:
        raise BackupSuperseded(f"{src} is gone (superseded before its backup)") from None
    try:
        manifest_raw = _read_regular_at(src_fd, MANIFEST_NAME, _MAX_MANIFEST_BYTES)
        m = _read_manifest_at(src_fd, key)
        if src.name != step_dir_name(m.step):
            raise CheckpointError(f"{src} is not a committed checkpoint directory")
        # open every source file now: retention may unlink them meanwhile, an open fd still reads
        fds: dict[str, int] = {}
        try:
            for entry in m.files:
                try:
                    fds[entry.path] = _open_beneath(src_fd, entry.path)
                except FileNotFoundError:
                    raise BackupSuperseded(f"{src.name}/{entry.path} is gone") from None
            return _copy_checkpoint(fds, manifest_raw, m, backup_root, key, keep, chunk)
        finally:
            for fd in fds.values():
                os.close(fd)
    finally:
        os.close(src_fd)


def _copy_checkpoint(
    fds: Mapping[str, int],
    manifest_raw: bytes,
    m: Manifest,
    backup_root: Path,
    key: bytes | None,
    keep: int,
    chunk: int,
) -> Path:
    name = step_dir_name(m.step)
    final = backup_root / name
    if os.path.lexists(final):
        st = inspect(final, verify_checksums=False, key=key)
        if st.state == VALIDATED:
            return final  # backed up already (a restart re-committed nothing new)
        raise CheckpointError(f"{final} exists and is {st.state}: {st.reason}")
    partial = partial_dir(backup_root, m.step)
    part_fd = _open_dir_at(None, str(partial))
    created: list[str] = []
    try:
        try:
            for entry in m.files:
                created.append(entry.path)
                _copy_one(fds[entry.path], part_fd, entry, chunk)
            problems = _listing_problems(part_fd, m, ignore=_RESERVED)
            if not problems:
                problems = _checksum_problems(part_fd, m, None)
        except (OSError, CheckpointError):  # I/O error, or a source that fails its manifest
            _remove_copy(part_fd, created)
            os.close(part_fd)
            part_fd = -1
            with contextlib.suppress(OSError):
                os.rmdir(partial)
            raise
        if problems:
            os.close(part_fd)
            part_fd = -1
            quarantine(partial, "backup copy failed verification: " + _join(problems),
                       state=CORRUPT, key=key)  # fmt: skip
            raise CheckpointError(f"backup copy of {name} is wrong: {_join(problems)}")
        try:
            _write_durably_at(part_fd, MANIFEST_NAME, manifest_raw)
            _fsync_fd(part_fd)
        except OSError:
            _remove_copy(part_fd, created)
            os.close(part_fd)
            part_fd = -1
            with contextlib.suppress(OSError):
                os.rmdir(partial)
            raise
    finally:
        if part_fd >= 0:
            os.close(part_fd)
    os.rename(partial, final)
    try:
        _fsync_dir(backup_root)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(final, partial)
        raise
    verified = {identity(final)}
    try:
        apply_retention(backup_root, keep, key=key, verified=verified)
        quarantine_failed_saves(backup_root, m.step, key=key)
    except (OSError, CheckpointError) as e:  # the copy is committed; retention tries again
        log.warning("backup retention under %s: %s", backup_root, e)
    return final


def _copy_one(src_fd: int, part_fd: int, entry: FileEntry, chunk: int) -> None:
    """Copy one file into the partial dir, checking the source bytes against ``entry``."""
    *parents, leaf = entry.path.split("/")
    dir_fd = part_fd
    try:
        for part in parents:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=dir_fd)
            nxt = _open_dir_at(dir_fd, part)
            if dir_fd != part_fd:
                os.close(dir_fd)
            dir_fd = nxt
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(leaf, flags, 0o644, dir_fd=dir_fd)
    finally:
        if dir_fd != part_fd:
            os.close(dir_fd)
    try:
        h = _hasher(entry.algorithm)
        buf = bytearray(max(1, min(chunk, entry.size + 1)))
        mv = memoryview(buf)
        size, offset = 0, 0
        while True:
            n = os.preadv(src_fd, [buf], offset)
            if not n:
                break
            offset += n
            h.update(mv[:n])
            view = mv[:n]
            while view:
                view = view[os.write(out, view) :]
            size += n
        if size != entry.size or h.hexdigest() != entry.digest:
            raise CheckpointError(
                f"source {entry.path} does not match its manifest ({size} bytes, "
                f"{entry.algorithm} {h.hexdigest()[:12]}...): not backed up"
            )
        os.fsync(out)
        # read back from the device, not from the page cache we just filled
        os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(out)


def _remove_copy(part_fd: int, rels: Iterable[str]) -> None:
    """Remove the files a failed copy created (only those), deepest directories last."""
    for rel in rels:
        with contextlib.suppress(OSError, CheckpointError):
            _unlink_beneath(part_fd, rel)
    parents = {"/".join(r.split("/")[:i]) for r in rels for i in range(1, r.count("/") + 1)}
    for sub in sorted(parents, key=lambda d: d.count("/"), reverse=True):
        with contextlib.suppress(OSError, CheckpointError):
            _rmdir_beneath(part_fd, sub)


def _lower_priority(cpu: bool = True) -> None:
    """This thread to best-effort I/O class level 7 and, with `cpu`, the lowest CPU priority
    (nice 19): it then runs in the time training leaves idle. Linux applies both per thread
    (tid)."""
    tid = threading.get_native_id()
    if cpu:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    with contextlib.suppress(Exception):
        import ctypes
        import platform

        nr = {"x86_64": 251, "aarch64": 30}.get(platform.machine())  # SYS_ioprio_set
        if nr is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(nr, 1, tid, (2 << 13) | 7)  # IOPRIO_WHO_PROCESS, BE class, level 7


lower_priority = _lower_priority  # for the trainer's checkpoint thread


class BackupWorker:
    """Copies validated checkpoints to a backup root in one low-priority daemon thread.

    ``submit(step_dir)`` never blocks: the newest submitted checkpoint waits while a copy
    runs, and an older waiting one is dropped (counted in ``skipped``). Every attempt updates
    the counters and, when ``status_path`` is set, a JSON status file written atomically
    (``status()``): how many copies succeeded and failed, the consecutive failures, the last
    error and the newest step backed up. A failure is counted and logged, never raised."""

    def __init__(
        self,
        backup_root: str | os.PathLike[str],
        *,
        keep: int = 0,
        key: bytes | None = None,
        status_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.root = Path(backup_root)
        self.keep = keep
        self.key = key
        self.status_path = Path(status_path) if status_path is not None else None
        self.ok = 0
        self.failed = 0
        self.skipped = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.newest_step: int | None = None
        self.seconds = 0.0
        self._pending: Path | None = None
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rankguard-backup", daemon=True)
        self._thread.start()

    def submit(self, step_dir: str | os.PathLike[str]) -> None:
        with self._cv:
            if self._pending is not None:
                self.skipped += 1
            self._pending = Path(step_dir)
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is waiting or copying; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the copy in flight and the one waiting (up to ``timeout``), then stop."""
        done = self.wait(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if done:
            self._thread.join(timeout=5)
        return done

    def status(self) -> dict[str, Any]:
        return {
            "format": "rankguard-backup-status",
            "backup_root": str(self.root.absolute()),
            "keep": self.keep,
            "copies_ok": self.ok,
            "copies_failed": self.failed,
            "copies_skipped": self.skipped,
            "consecutive_failures": self.consecutive_failures,
            "failing": self.consecutive_failures > 0,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "newest_backed_up": self.newest_step,
            "copy_seconds": round(self.seconds, 3),
            "updated_at": time.time(),
        }

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                src, self._pending, self._busy = self._pending, None, True
            try:
                self._copy(src)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _copy(self, src: Path) -> None:
        start = time.perf_counter()
        try:
            final = backup_checkpoint(src, self.root, key=self.key, keep=self.keep)
        except BackupSuperseded as e:
            self.skipped += 1
            log.info("backup of %s skipped: %s", src.name, e)
        except Exception as e:  # ENOSPC, EIO, a bad copy: counted, training goes on
            self.failed += 1
            self.consecutive_failures += 1
            self.last_error = f"{src.name}: {type(e).__name__}: {e}"
            self.last_error_at = time.time()
            log.error("backup of %s to %s failed: %s", src.name, self.root, self.last_error)
        else:
            self.ok += 1
            self.consecutive_failures = 0
            parsed = parse_step_dir_name(final.name)
            if parsed is not None:
                self.newest_step = max(parsed[0], self.newest_step or 0)
        self.seconds += time.perf_counter() - start
        self._write_status()

    def _write_status(self) -> None:
        if self.status_path is None:
            return
        try:
            data = json.dumps(self.status(), indent=2).encode() + b"\n"
            _write_durably(self.status_path, data)
        except OSError as e:
            log.warning("cannot write %s: %s", self.status_path, e)


def read_backup_status(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The backup status file a trainer keeps in checkpoint root ``root``, or None."""
    try:
        fd = _open_dir_at(None, str(root))
    except (OSError, CheckpointError):
        return None
    try:
        doc = json.loads(_read_regular_at(fd, BACKUP_STATUS_NAME, _MAX_SMALL_FILE))
    except (OSError, ValueError, RecursionError, CheckpointError):
        return None
    finally:
        os.close(fd)
    return doc if isinstance(doc, dict) else None


# --------------------------------------------------------------------------- resume across tiers


@dataclass(frozen=True)
class Candidate:
    """A state a resume could load: ``step`` held by ``tier`` at ``path``. ``order`` is the
    tier's place in the resume order (lower: faster; the disk tier is 1, backup 2, so an
    in-memory tier 0 sorts in front)."""

    step: int
    tier: str
    order: int
    path: Path


def resume_candidates(
    tiers: Iterable[tuple[str, str | os.PathLike[str] | None]],
    *,
    extra: Iterable[Candidate] = (),
) -> list[Candidate]:
    """Every committed checkpoint of each (name, root) tier, newest step first and, within a
    step, fastest tier first (the order ``tiers`` are given in, numbered from 1). ``extra``:
    candidates of other tiers (an in-memory tier 0) merged in. Nothing is read but the
    directory listings; ``select_resume_tiers`` verifies them in this order."""
    found = list(extra)
    for order, (name, root) in enumerate(tiers, start=1):
        if root is None:
            continue
        try:
            committed, _, _ = _entries(Path(root))
        except (FileNotFoundError, NotADirectoryError):
            continue  # a lost tier holds nothing
        found.extend(Candidate(step, name, order, p) for step, p in committed)
    return sorted(found, key=lambda c: (-c.step, c.order, c.tier))


def select_resume_tiers(
    tiers: Iterable[tuple[str, str | os.PathLike[str] | None]],
    progress: Progress | None = None,
    *,
    key: bytes | None = None,
) -> tuple[tuple[str, CheckpointStatus] | None, list[CheckpointStatus]]:
    """``select_resume`` across tiers: the newest validated state, from the fastest tier that
    holds it (disk before backup). Every ``.partial`` of every tier is quarantined; each
    candidate met that is incomplete or corrupt is quarantined in its own tier and the next
    best is tried (an older step on disk, or the same step in the backup). Returns
    ((tier name, status) or None, quarantined statuses)."""
    tiers = [(n, r) for n, r in tiers if r is not None]
    moved: list[CheckpointStatus] = []
    for _, root in tiers:
        try:
            _, partial, _ = _entries(Path(root))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for _, p in sorted(partial):
            with contextlib.suppress(CheckpointError):
                st = inspect(p, verify_checksums=False, key=key)
                _put_aside(st, key, moved)
    hashed = 0
    for c in resume_candidates(tiers):
        base = hashed

        def sub(done: int, total: int, base: int = base) -> None:
            if progress is not None:
                progress(base + done, base + total)

        try:
            st, m = _inspect(c.path, True, sub, key)
        except CheckpointError:
            continue
        hashed += m.total_bytes if m else 0
        if st.state == VALIDATED:
            return (c.tier, st), moved
        _put_aside(st, key, moved)
    return None, moved


def _put_aside(st: CheckpointStatus, key: bytes | None, moved: list[CheckpointStatus]) -> None:
    try:
        dest = quarantine(st, st.reason, key=key)
    except (OSError, CheckpointError) as e:
        log.warning("cannot quarantine %s (%s); left in place, never chosen", st.path.name, e)
        return
    moved.append(dataclasses.replace(st, path=dest, state=QUARANTINED, original_state=st.state))
