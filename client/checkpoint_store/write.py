"""The write path: the job's incarnation number, ``.partial`` directories, hashing files for
the manifest, and the commit (``_commit_partial``: the one place a step directory becomes
committed, for a new save and for a backup copy alike)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .fsio import (
    _checksum_file,
    _fsync_dir,
    _fsync_fd,
    _lstat_mode,
    _open_dir_at,
    _overwrite_in_place_at,
    _read_regular_at,
    _walk_files,
    _write_durably_at,
)
from .layout import (
    _MAX_SMALL_FILE,
    _RESERVED,
    DEFAULT_CHUNK,
    INCARNATION_FILE,
    INCOMPLETE,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    SHA256,
    CheckpointError,
    _unsafe_path_reason,
    step_dir_name,
)
from .manifest import FileEntry, Manifest, sign_manifest
from .quarantines import quarantine
from .read import _join, _listing_problems


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
    size, digest = _checksum_file(path, chunk, fsync=fsync, algorithm=algorithm)
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
        if problems:
            raise CheckpointError(f"cannot commit {partial.name}: " + _join(problems))
        return _commit_partial(fd, partial, final, data)
    finally:
        os.close(fd)


def _commit_partial(
    part_fd: int,
    partial: Path,
    final: Path,
    manifest: bytes,
    undo: Callable[[], None] | None = None,
) -> Path:
    """The commit step: the one place a step directory becomes committed, for a new save
    (``commit``) and a backup copy (``backup_checkpoint``) alike. The caller has checked the
    directory against the manifest; ``part_fd`` is ``partial`` opened.

    1. ``manifest`` (its bytes) is written durably inside the still-partial dir; 2. the dir is
    fsynced, so the manifest's entry is durable; 3. the commit point: the atomic rename
    ``partial`` -> ``final``; 4. the root is fsynced, so the rename is durable, or it is
    undone. Raises OSError (e.g. ENOSPC) with nothing committed: when the manifest could not
    be written ``undo`` runs first (a backup removes its copy); after a failed rename or
    root fsync the ``.partial`` is left as it is."""
    try:
        _write_durably_at(part_fd, MANIFEST_NAME, manifest)
        _fsync_fd(part_fd)
    except OSError:
        if undo is not None:
            undo()
        raise
    os.rename(partial, final)
    try:
        _fsync_dir(partial.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(final, partial)
        raise
    return final
