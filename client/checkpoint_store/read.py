"""The read path: reading and verifying manifests, judging one directory (``inspect``:
validated, incomplete, corrupt, quarantined) and every entry of a root (``scan``)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .fsio import (
    _checksum_fd,
    _open_beneath,
    _open_dir_at,
    _read_regular_at,
    _read_tree,
    _tree_size,
)
from .layout import (
    _MAX_MANIFEST_BYTES,
    _MAX_SMALL_FILE,
    _QUARANTINE_ENTRY_RE,
    CORRUPT,
    DEFAULT_CHUNK,
    INCOMPLETE,
    MANIFEST_NAME,
    QUARANTINE_DIRNAME,
    QUARANTINE_RECORD,
    QUARANTINED,
    VALIDATED,
    CheckpointError,
    Progress,
    UntrustedManifest,
    _short,
    parse_step_dir_name,
)
from .manifest import CheckpointStatus, Manifest, check_signature


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
                    _size, digest = _checksum_fd(fd, DEFAULT_CHUNK, on_bytes, entry.algorithm)
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
