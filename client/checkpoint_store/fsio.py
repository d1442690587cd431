"""Low-level I/O under a checkpoint root: fsync, descriptor-relative opens that never follow
a symbolic link, atomic durable writes, checksums of open files, and directory trees."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...contract import crc
from .layout import _DIR_FLAGS, _READ_FLAGS, CHECKSUMS, CRC32, SHA256, CheckpointError


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


def _checksum_fd(
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


def _checksum_file(
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
        return _checksum_fd(fd, chunk, on_bytes, algorithm)
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


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _lstat_mode_at(dir_fd: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return 0


def _unlink_beneath(dir_fd: int, rel: str) -> None:
    _in_parent_beneath(dir_fd, rel, os.unlink)  # a symlink itself is removed, never its target


def _rmdir_beneath(dir_fd: int, rel: str) -> None:
    _in_parent_beneath(dir_fd, rel, os.rmdir)


def _in_parent_beneath(dir_fd: int, rel: str, op: Callable[..., None]) -> None:
    """``op(leaf, dir_fd=parent)`` on ``rel``'s last component, its parent opened under
    ``dir_fd`` without following a symlink."""
    *parents, leaf = rel.split("/")
    if not parents:
        op(leaf, dir_fd=dir_fd)
        return
    sub = _open_beneath(dir_fd, "/".join(parents), _DIR_FLAGS)
    try:
        op(leaf, dir_fd=sub)
    finally:
        os.close(sub)


def _rmdir_emptied(dir_fd: int, rels: Collection[str]) -> None:
    """Remove the directories above the files ``rels`` (relative to ``dir_fd``), deepest
    first; one that still holds anything, or cannot be reached, stays."""
    parents = {"/".join(r.split("/")[:i]) for r in rels for i in range(1, r.count("/") + 1)}
    for sub in sorted(parents, key=lambda d: d.count("/"), reverse=True):
        with contextlib.suppress(OSError, CheckpointError):
            _rmdir_beneath(dir_fd, sub)
