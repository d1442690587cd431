"""Choosing the checkpoint to resume from: ``select_resume`` on one root, and
``select_resume_tiers`` across tiers (disk, then backup), quarantining every bad one met."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .layout import QUARANTINED, TIER_DISK, VALIDATED, CheckpointError, Progress
from .manifest import CheckpointStatus
from .quarantines import quarantine
from .read import _entries, _inspect, inspect

log = logging.getLogger(__package__)


def select_resume(
    root: str | os.PathLike[str], progress: Progress | None = None, *, key: bytes | None = None
) -> tuple[CheckpointStatus | None, list[CheckpointStatus]]:
    """Pick the checkpoint to resume from (rank 0, at every (re)start, with no save running).

    Every ``.partial`` is quarantined; committed dirs are verified newest-first with checksums
    (and, with ``key``, their manifest's HMAC, before any of their files is read), each
    incomplete/corrupt one met is quarantined with its reason, and the first validated one
    is returned (older ones are not read). Returns (newest validated or None, quarantined
    statuses with state "quarantined", their new path and ``original_state``)."""
    found, moved = select_resume_tiers([(TIER_DISK, root)], progress, key=key)
    return (found[1] if found else None), moved


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
