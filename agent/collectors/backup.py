"""Checkpoint backup collector: the backup tier's state, from the status file the trainer's
rank 0 keeps in the checkpoint directory (``backup-status.json``: copies made and failed,
consecutive failures, the newest step backed up; see client/checkpoint_store/backup.py).

The file lives in the *disk* tier because a full or failing backup target cannot hold it.
No file (no backup tier configured, or none yet) exports failing 0 and no counters, so
the alert on ``rankguard_checkpoint_backup_failing`` has its series on every node that
watches a checkpoint directory.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from . import Collector, CollectorResult, counter, gauge, register

STATUS_NAME = "backup-status.json"  # client/checkpoint_store.BACKUP_STATUS_NAME
MAX_STATUS_BYTES = 1024 * 1024


def parse_status(raw: bytes) -> dict[str, Any]:
    """The fields the metrics use, validated; ValueError names the bad one."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("format") != "rankguard-backup-status":
        raise ValueError("not a rankguard backup status file")
    out: dict[str, Any] = {}
    for name in ("copies_ok", "copies_failed", "consecutive_failures"):
        v = doc.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        out[name] = v
    newest = doc.get("newest_backed_up")
    if newest is not None and (isinstance(newest, bool) or not isinstance(newest, int)):
        raise ValueError(f"newest_backed_up must be an integer or null, got {newest!r}")
    out["newest_backed_up"] = newest
    out["last_error"] = doc.get("last_error") if isinstance(doc.get("last_error"), str) else None
    out["backup_root"] = doc.get("backup_root") if isinstance(doc.get("backup_root"), str) else None
    return out


@register
class BackupCollector(Collector):
    name = "backup"

    def collect(self) -> CollectorResult:
        result = CollectorResult()
        failing = gauge(
            "rankguard_checkpoint_backup_failing",
            "1 while the trainer's copies to the checkpoint backup tier fail, else 0.",
        )
        root = self.ctx.watch_dirs.get("checkpoint")
        if root is None:
            return result
        try:
            status = parse_status(_read_small(os.path.join(root, STATUS_NAME)))
        except FileNotFoundError:
            failing.add((), 0)
            result.metrics.append(failing)
            result.facts["backup"] = None
            return result
        except (OSError, ValueError, RecursionError) as exc:
            raise ValueError(f"{STATUS_NAME}: {exc}") from None
        failing.add((), 1 if status["consecutive_failures"] > 0 else 0)
        copies = counter(
            "rankguard_checkpoint_backup_copies_total",
            "Checkpoints copied to the backup tier and verified there.",
        ).add((), status["copies_ok"])
        failed = counter(
            "rankguard_checkpoint_backup_copies_failed_total",
            "Copies to the backup tier that failed (full, failing or wrong target).",
        ).add((), status["copies_failed"])
        result.metrics += [failing, copies, failed]
        if status["newest_backed_up"] is not None:
            result.metrics.append(
                gauge(
                    "rankguard_checkpoint_backup_newest_step",
                    "Step of the newest checkpoint copied to the backup tier.",
                ).add((), status["newest_backed_up"])
            )
        result.facts["backup"] = status
        return result


def _read_small(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = os.read(fd, MAX_STATUS_BYTES + 1)
        if len(data) > MAX_STATUS_BYTES:
            raise ValueError(f"larger than {MAX_STATUS_BYTES} bytes")
        return data
    finally:
        os.close(fd)
