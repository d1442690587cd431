"""Quarantine: moving a checkpoint aside under ``ROOT/quarantine/`` with its record, never
deleting it; and the failed saves a later commit leaves behind."""

from __future__ import annotations

import json
import logging
import os
import stat
from datetime import datetime, timezone
from pathlib import Path

from .fsio import _fsync_fd, _lstat_mode_at, _open_dir_at, _utc_stamp, _write_durably_at
from .layout import (
    INCOMPLETE,
    QUARANTINE_DIRNAME,
    QUARANTINE_RECORD,
    CheckpointError,
    parse_step_dir_name,
)
from .manifest import CheckpointStatus
from .read import _entries, inspect

log = logging.getLogger(__package__)


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
