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

Modules (every name above is importable from this package):

- ``layout``: names and constants of a root (``MANIFEST_NAME``, states, ``STEP_DIR_RE``,
  ``step_dir_name``), ``CheckpointError``.
- ``manifest``: ``FileEntry``, ``Manifest``, ``CheckpointStatus``; keys and HMAC seals.
- ``pickles``: ``DataUnpickler``.
- ``fsio``: fsync, symlink-refusing descriptor I/O, atomic writes, checksums, trees.
- ``read``: ``read_manifest``, ``inspect``, ``scan``.
- ``quarantines``: ``quarantine``, ``quarantine_failed_saves``.
- ``write``: ``claim_incarnation``, ``partial_dir``, ``hash_file``, ``commit``, and the one
  commit step (``write._commit_partial``) a backup copy is committed through too.
- ``retention``: ``apply_retention``, ``identity``.
- ``backup``: tier 2: ``backup_checkpoint``, ``BackupWorker``, ``read_backup_status``.
- ``resume``: ``select_resume``, ``select_resume_tiers``, ``resume_candidates``.
"""

from __future__ import annotations

from .backup import (
    BACKUP_STATUS_NAME,
    BackupSuperseded,
    BackupWorker,
    backup_checkpoint,
    lower_priority,
    read_backup_status,
)
from .layout import (
    CHECKSUMS,
    CORRUPT,
    CRC32,
    DEFAULT_CHUNK,
    FORMAT,
    FORMAT_VERSION,
    HMAC_ALG,
    HMAC_FIELD,
    INCARNATION_FILE,
    INCOMPLETE,
    KEY_FILE_ENV,
    MANIFEST_NAME,
    MANIFEST_TMP_NAME,
    MIN_KEY_BYTES,
    PARTIAL_SUFFIX,
    QUARANTINE_DIRNAME,
    QUARANTINE_RECORD,
    QUARANTINED,
    SHA256,
    STATES,
    STEP_DIR_RE,
    TIER_BACKUP,
    TIER_DISK,
    VALIDATED,
    CheckpointError,
    Progress,
    UntrustedManifest,
    checksum_for,
    parse_step_dir_name,
    step_dir_name,
)
from .manifest import (
    CheckpointStatus,
    FileEntry,
    Manifest,
    check_signature,
    key_id,
    load_key,
    resolve_key,
    sign_manifest,
)
from .pickles import (
    DataUnpickler,
)
from .quarantines import (
    quarantine,
    quarantine_failed_saves,
)
from .read import (
    inspect,
    read_manifest,
    scan,
)
from .resume import (
    Candidate,
    resume_candidates,
    select_resume,
    select_resume_tiers,
)
from .retention import (
    apply_retention,
    identity,
)
from .write import (
    claim_incarnation,
    commit,
    ensure_partial_dir,
    hash_file,
    hash_tree,
    partial_dir,
)

__all__ = [
    "BACKUP_STATUS_NAME",
    "BackupSuperseded",
    "BackupWorker",
    "CHECKSUMS",
    "CORRUPT",
    "CRC32",
    "Candidate",
    "CheckpointError",
    "CheckpointStatus",
    "DEFAULT_CHUNK",
    "DataUnpickler",
    "FORMAT",
    "FORMAT_VERSION",
    "FileEntry",
    "HMAC_ALG",
    "HMAC_FIELD",
    "INCARNATION_FILE",
    "INCOMPLETE",
    "KEY_FILE_ENV",
    "MANIFEST_NAME",
    "MANIFEST_TMP_NAME",
    "MIN_KEY_BYTES",
    "Manifest",
    "PARTIAL_SUFFIX",
    "Progress",
    "QUARANTINED",
    "QUARANTINE_DIRNAME",
    "QUARANTINE_RECORD",
    "SHA256",
    "STATES",
    "STEP_DIR_RE",
    "TIER_BACKUP",
    "TIER_DISK",
    "UntrustedManifest",
    "VALIDATED",
    "apply_retention",
    "backup_checkpoint",
    "check_signature",
    "checksum_for",
    "claim_incarnation",
    "commit",
    "ensure_partial_dir",
    "hash_file",
    "hash_tree",
    "identity",
    "inspect",
    "key_id",
    "load_key",
    "lower_priority",
    "parse_step_dir_name",
    "partial_dir",
    "quarantine",
    "quarantine_failed_saves",
    "read_backup_status",
    "read_manifest",
    "resolve_key",
    "resume_candidates",
    "scan",
    "select_resume",
    "select_resume_tiers",
    "sign_manifest",
    "step_dir_name",
]
