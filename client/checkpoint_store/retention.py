"""Retention: deleting validated checkpoints beyond the newest ``keep`` verified ones, only
the files their manifests list, through a hidden trash name a crash cannot leave half-done."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Collection
from pathlib import Path

from .fsio import _fsync_fd, _open_dir_at, _rmdir_emptied, _unlink_beneath, _utc_stamp
from .layout import MANIFEST_NAME, VALIDATED, CheckpointError
from .read import _entries, _read_manifest_at, inspect

log = logging.getLogger(__package__)

_TRASH_PREFIX = ".trash-"
_TRASH_RE = re.compile(r"^\.trash-step-\d{8,}\.")


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
        _rmdir_emptied(fd, listed)
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
