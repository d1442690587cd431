"""`rankguard checkpoints ...`: list and verify the checkpoints in a checkpoint directory.

Standard library + typer only (no torch): runs on a head node. Read-only: nothing here moves,
quarantines or deletes a checkpoint (the trainer's resume does that). Both tiers on disk are
shown: DIR, and the backup root (``--backup``, or the one DIR/backup-status.json names).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ..client import checkpoint_store as store
from ..client.checkpoint_store import CheckpointError, CheckpointStatus

_STATES_HELP = (
    "States: validated = committed, manifest.json present and every file matches it (sizes, "
    "and checksums when verified). incomplete = a .partial dir (save in progress or "
    "interrupted), or a step dir whose manifest.json is missing, unreadable, of another format "
    "or of another step. corrupt = a listed file is missing, truncated, changed (checksum), "
    "an unlisted file or any symbolic link is present, or (with --key-file) the manifest's "
    "HMAC is missing or wrong. quarantined = moved aside under DIR/quarantine/ by a resume "
    "(never deleted).\n\n"
    "Checksums: CRC-32 (catches torn writes and flipped bits), or SHA-256 when the job "
    "signs its manifests with a key (tamper-evident); each manifest names its own.\n\n"
)

_EXIT_HELP = (
    "Exit codes: 0 = the newest committed checkpoint is validated. 1 = degraded: the newest is "
    "not valid but an older validated one exists, on disk or in the backup tier (a resume "
    "falls back to it). 2 = no validated checkpoint in any tier, or DIR missing or unreadable "
    "with no backup tier. A .partial dir (a save in progress) does not count as the newest "
    "checkpoint.\n\n"
)

_TIERS_HELP = (
    "Tiers: DIR is the disk tier; the backup tier (the trainer's --ckpt-backup) is listed "
    "after it, found in DIR/backup-status.json or given with --backup. A resume loads the "
    "newest validated state, from disk before backup."
)

app = typer.Typer(
    no_args_is_help=True,
    help="Inspect and verify training checkpoints (read-only).\n\n" + _STATES_HELP + _EXIT_HELP,
)

DirArg = Annotated[
    Path,
    typer.Argument(
        help="Checkpoint root directory (holds step-NNNNNNNN/ dirs).", show_default=False
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]
BackupOpt = Annotated[
    Path | None,
    typer.Option(
        "--backup",
        help="The backup tier's root (the trainer's --ckpt-backup). Default: the one named in "
        "DIR/backup-status.json, if any.",
        show_default=False,
    ),
]
KeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--key-file",
        help="Checkpoint key (the trainer's --ckpt-key-file): manifests without a valid HMAC "
        "are then corrupt. Default: $RANKGUARD_CHECKPOINT_KEY_FILE; none: SHA-256 only "
        "(catches corruption, not tampering).",
        show_default=False,
    ),
]

EXIT_OK, EXIT_DEGRADED, EXIT_UNHEALTHY = 0, 1, 2
_STATUS_NAMES = {EXIT_OK: "healthy", EXIT_DEGRADED: "degraded", EXIT_UNHEALTHY: "unhealthy"}


# --------------------------------------------------------------------------- formatting


def printable(value: object) -> str:
    """``value`` as text with every non-printable character escaped as ``repr`` does
    (``\\x1b``, ``\\n``, ``\\u202e``). Names and reasons come from files that whoever can
    write into a root named: raw, an escape sequence would drive the reader's terminal
    and a newline could forge a line of the report. (JSON output is escaped by json.)"""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if s < limit:
            return f"{s // div}{unit}"
    return f"{s // 86400}d"


NOT_VERIFIED = "committed (not verified)"


def _state_label(s: CheckpointStatus, checksums: bool = True) -> str:
    if s.state == store.QUARANTINED and s.original_state:
        return f"quarantined ({printable(s.original_state)})"
    if s.state == store.VALIDATED and not checksums:
        # sizes match the manifest, but a flipped byte has the same size: only --verify
        # (every file's checksum) may call it validated
        return NOT_VERIFIED
    return s.state


def render_table(
    statuses: list[CheckpointStatus], now: float | None = None, checksums: bool = True
) -> str:
    now = time.time() if now is None else now
    header = ("STEP", "STATE", "SIZE", "WORLD", "AGE", "REASON")
    rows = [header]
    for s in statuses:
        rows.append(
            (
                str(s.step),
                _state_label(s, checksums),
                human_bytes(s.size_bytes),
                "-" if s.world_size is None else str(s.world_size),
                human_age(None if s.created_at is None else now - s.created_at),
                printable(s.reason or "-"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [
            c.rjust(w) if i in (0, 2, 3, 4) else c.ljust(w)
            for i, (c, w) in enumerate(zip(r[:-1], widths, strict=True))
        ]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- verdict


def verdict(statuses: list[CheckpointStatus]) -> tuple[int, int | None, int | None]:
    """(exit code, newest committed step, newest validated step)."""
    committed = [s for s in statuses if s.is_committed]
    validated = [s.step for s in committed if s.state == store.VALIDATED]
    newest = max((s.step for s in committed), default=None)
    newest_valid = max(validated, default=None)
    if newest_valid is None:
        return EXIT_UNHEALTHY, newest, None
    return (EXIT_OK if newest_valid == newest else EXIT_DEGRADED), newest, newest_valid


def _tier_doc(name: str, root: Path, statuses: list[CheckpointStatus] | None, error: str | None):
    _, newest, newest_valid = verdict(statuses or [])
    return {
        "tier": name,
        "root": str(root),
        "error": error,
        "newest_step": newest,
        "newest_validated": newest_valid,
        "checkpoints": [s.to_dict() for s in statuses or []],
    }


def _verdict_doc(
    code: int, newest: int | None, newest_valid: int | None, statuses: list[CheckpointStatus]
) -> dict:
    """The verdict keys of the --json report, of a listing and of a root that failed alike."""
    return {
        "newest_step": newest,
        "newest_validated": newest_valid,
        "newest_is_valid": code == EXIT_OK,
        "status": _STATUS_NAMES[code],
        "checkpoints": [s.to_dict() for s in statuses],
    }


def _report(
    root: Path,
    statuses: list[CheckpointStatus],
    as_json: bool,
    checksums: bool,
    backup: tuple[Path, list[CheckpointStatus] | None, str | None] | None = None,
    backup_status: dict | None = None,
    disk_error: str | None = None,
) -> int:
    code, newest, newest_valid = verdict(statuses)
    backup_valid = verdict(backup[1] or [])[2] if backup is not None else None
    if code == EXIT_UNHEALTHY and backup_valid is not None:
        code = EXIT_DEGRADED  # a resume falls back to the backup tier
    if as_json:
        doc = {
            "root": str(root),
            "checksums_verified": checksums,
            **_verdict_doc(code, newest, newest_valid, statuses),
            "tiers": [_tier_doc(store.TIER_DISK, root, statuses, disk_error)],
            "backup_status": backup_status,
        }
        if disk_error:
            doc["error"] = disk_error
        if backup is not None:
            doc["tiers"].append(_tier_doc(store.TIER_BACKUP, *backup))
        typer.echo(json.dumps(doc, indent=2, default=str))
        return code
    if disk_error:
        typer.echo(f"disk tier {printable(root)}: {printable(disk_error)}")
    elif statuses:
        typer.echo(render_table(statuses, checksums=checksums))
    else:
        typer.echo(f"no checkpoints in {printable(root)}")
    if backup is not None:
        broot, bstatuses, berror = backup
        typer.echo(f"\nbackup tier {printable(broot)}:")
        if berror:
            typer.echo(f"  {printable(berror)}")
        elif bstatuses:
            typer.echo(render_table(bstatuses, checksums=checksums))
        else:
            typer.echo("no checkpoints in the backup tier")
        if backup_valid is not None:
            typer.echo(f"newest validated backup: step {backup_valid}")
    if backup_status is not None and backup_status.get("failing"):
        typer.echo(
            f"BACKUP FAILING: {printable(backup_status.get('consecutive_failures'))} "
            f"consecutive copy failures ({printable(backup_status.get('copies_failed'))} in "
            f"all); last: {printable(backup_status.get('last_error'))}"
        )
    if newest_valid is None and backup_valid is not None:
        typer.echo(
            f"DEGRADED: no validated checkpoint on disk; a resume uses backup step {backup_valid}"
        )
    elif code == EXIT_OK and not checksums:
        typer.echo(
            f"newest checkpoint step {newest} is committed and its file sizes match its "
            "manifest; checksums not verified (--verify reads every file and checks its checksum)"
        )
    elif code == EXIT_OK:
        typer.echo(f"newest checkpoint step {newest} is validated")
    elif code == EXIT_DEGRADED:
        typer.echo(
            f"DEGRADED: newest checkpoint step {newest} is not valid; "
            f"newest validated is step {newest_valid}"
        )
    else:
        typer.echo("UNHEALTHY: no validated checkpoint")
    return code


def _fail(root: Path, message: str, as_json: bool) -> typer.Exit:
    typer.echo(f"error: {printable(message)}", err=True)
    if as_json:
        doc = {
            "root": str(root),
            "error": message,
            **_verdict_doc(EXIT_UNHEALTHY, None, None, []),
        }
        typer.echo(json.dumps(doc, indent=2))
    return typer.Exit(EXIT_UNHEALTHY)


def _scan_tier(
    root: Path, checksums: bool, progress: Any, key: bytes | None
) -> tuple[list[CheckpointStatus] | None, str | None]:
    if not root.exists():
        return None, f"checkpoint directory {root} does not exist"
    if not root.is_dir():
        return None, f"{root} is not a directory"
    try:
        return store.scan(root, verify_checksums=checksums, progress=progress, key=key), None
    except (CheckpointError, OSError) as e:
        return None, f"cannot read {root}: {e}"


def _run(
    root: Path,
    checksums: bool,
    as_json: bool,
    progress: Any,
    key_file: Path | None,
    backup: Path | None,
) -> int:
    try:
        key = store.resolve_key(key_file)
    except CheckpointError as e:
        raise _fail(root, str(e), as_json) from None
    backup_status = store.read_backup_status(root)
    if backup is None and backup_status is not None:
        named = backup_status.get("backup_root")
        backup = Path(named) if isinstance(named, str) and named else None
    statuses, error = _scan_tier(root, checksums, progress, key)
    if error is not None and backup is None:
        raise _fail(root, error, as_json)
    tier2 = None
    if backup is not None:
        tier2 = (backup, *_scan_tier(backup, checksums, progress, key))
    if progress is not None:
        progress.finish()
    return _report(root, statuses or [], as_json, checksums, tier2, backup_status, error)


class _Progress:
    """`hashed X / Y (p%)` on stderr: live on a terminal, a line every few seconds otherwise."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.last = self.start
        self.done = self.total = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = time.monotonic()
        if now - self.last < (0.2 if self.tty else 5.0) or done >= total:
            return
        self.last = now
        self._write(end="\r" if self.tty else "\n")

    def _write(self, end: str) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        self.stream.write(
            f"hashed {human_bytes(self.done)} / {human_bytes(self.total)} ({pct:.0f}%){end}"
        )
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        elapsed = time.monotonic() - self.start
        self.stream.write(
            f"verified checksums: hashed {human_bytes(self.done)} / {human_bytes(self.total)} "
            f"in {elapsed:.1f}s\n"
        )
        self.stream.flush()


# --------------------------------------------------------------------------- commands


@app.command(
    "list",
    help="List checkpoints: step, state, size, world size, age, reason.\n\n"
    "Fast by default: files are checked against the manifest by size only, and a checkpoint "
    "that passes is shown as 'committed (not verified)' (a flipped byte keeps the size); "
    "--verify also checks every file's checksum (reads all data) and only then says "
    "'validated'.\n\n" + _STATES_HELP + _EXIT_HELP + _TIERS_HELP,
)
def list_(
    directory: DirArg,
    as_json: JsonOpt = False,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Also verify the checksums (slow).")
    ] = False,
    key_file: KeyFileOpt = None,
    backup: BackupOpt = None,
) -> None:
    progress = _Progress() if verify else None
    raise typer.Exit(_run(directory, verify, as_json, progress, key_file, backup))


@app.command(
    help="Verify every checkpoint in full (sizes and checksums), with "
    "progress on stderr. Read-only: never quarantines or deletes.\n\n"
    "JSON: {root, newest_validated, newest_is_valid, checkpoints: [...]}.\n\n"
    + _STATES_HELP
    + _EXIT_HELP
    + _TIERS_HELP
)
def verify(
    directory: DirArg,
    as_json: JsonOpt = False,
    key_file: KeyFileOpt = None,
    backup: BackupOpt = None,
) -> None:
    raise typer.Exit(_run(directory, True, as_json, _Progress(), key_file, backup))
