"""Tier 2: copying validated checkpoints to a backup root (``backup_checkpoint``, verified
as they are copied and read back, committed as a save is), the low-priority
``BackupWorker`` thread, and its status file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from .fsio import (
    _hasher,
    _open_beneath,
    _open_dir_at,
    _read_regular_at,
    _rmdir_emptied,
    _unlink_beneath,
    _write_durably,
)
from .layout import (
    _MAX_MANIFEST_BYTES,
    _MAX_SMALL_FILE,
    _RESERVED,
    CORRUPT,
    DEFAULT_CHUNK,
    MANIFEST_NAME,
    VALIDATED,
    CheckpointError,
    parse_step_dir_name,
    step_dir_name,
)
from .manifest import FileEntry, Manifest
from .quarantines import quarantine, quarantine_failed_saves
from .read import _checksum_problems, _join, _listing_problems, _read_manifest_at, inspect
from .retention import apply_retention, identity
from .write import _commit_partial, partial_dir

log = logging.getLogger(__package__)

# A backup root has the same layout as a checkpoint root: ``BACKUP/step-N`` is committed only
# by ``backup_checkpoint`` after every file was copied, fsynced and read back against the
# source's manifest; the manifest (its HMAC included) is copied byte for byte last. So every
# read function (scan, inspect, select_resume, apply_retention, quarantine) works on it.

BACKUP_STATUS_NAME = "backup-status.json"  # in the *disk* root: a full backup target can't hold it


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

    def discard() -> None:  # after an I/O error: a leftover copy would keep a full target full
        _remove_copy(part_fd, created)
        with contextlib.suppress(OSError):
            os.rmdir(partial)

    try:
        try:
            for entry in m.files:
                created.append(entry.path)
                _copy_one(fds[entry.path], part_fd, entry, chunk)
            problems = _listing_problems(part_fd, m, ignore=_RESERVED)
            if not problems:
                problems = _checksum_problems(part_fd, m, None)
        except (OSError, CheckpointError):  # I/O error, or a source that fails its manifest
            discard()
            raise
        if problems:
            quarantine(partial, "backup copy failed verification: " + _join(problems),
                       state=CORRUPT, key=key)  # fmt: skip
            raise CheckpointError(f"backup copy of {name} is wrong: {_join(problems)}")
        # the source's manifest, byte for byte (its HMAC included), committed as a save is
        _commit_partial(part_fd, partial, final, manifest_raw, undo=discard)
    finally:
        os.close(part_fd)
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


def _remove_copy(part_fd: int, rels: Collection[str]) -> None:
    """Remove the files a failed copy created (only those), deepest directories last."""
    for rel in rels:
        with contextlib.suppress(OSError, CheckpointError):
            _unlink_beneath(part_fd, rel)
    _rmdir_emptied(part_fd, rels)


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
