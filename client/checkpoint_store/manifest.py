"""The manifest and its types: ``FileEntry``, ``Manifest`` and ``CheckpointStatus`` (parsed
and validated from JSON), and keyed manifests (the checkpoint key, HMAC-SHA256 seals)."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...contract.secrets import SecretFileError, read_secret_file
from .layout import (
    _CRC32_RE,
    _SHA256_RE,
    CRC32,
    FORMAT,
    FORMAT_VERSION,
    HMAC_ALG,
    HMAC_FIELD,
    KEY_FILE_ENV,
    MANIFEST_NAME,
    MIN_KEY_BYTES,
    SHA256,
    CheckpointError,
    UntrustedManifest,
    _json_type,
    _short,
    _unsafe_path_reason,
    parse_step_dir_name,
)

# --------------------------------------------------------------------------- keys


def load_key(path: str | os.PathLike[str]) -> bytes:
    """The checkpoint key in ``path``: its bytes without trailing whitespace, at least
    ``MIN_KEY_BYTES`` long, in a regular file only its owner can read (like the agent token).
    Raises CheckpointError with a one-line reason."""
    try:
        return read_secret_file(path, "checkpoint key", MIN_KEY_BYTES, strip=bytes.rstrip)
    except SecretFileError as e:
        raise CheckpointError(str(e)) from None


def resolve_key(
    key_file: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """The key from ``key_file``, else from the file named by ``$RANKGUARD_CHECKPOINT_KEY_FILE``,
    else None (manifests then carry plain SHA-256 only: corruption is caught, tampering not)."""
    if key_file is None:
        key_file = (os.environ if environ is None else environ).get(KEY_FILE_ENV) or None
    return None if key_file is None else load_key(key_file)


def key_id(key: bytes) -> str:
    """A short public name of a key, so a mismatch can say "signed with another key"."""
    return hashlib.sha256(b"rankguard-checkpoint-key-id\0" + key).hexdigest()[:16]


def _signed_bytes(doc: Mapping[str, Any]) -> bytes:
    """The canonical bytes an HMAC covers: the manifest without its HMAC field."""
    body = {k: v for k, v in doc.items() if k != HMAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_manifest(doc: Mapping[str, Any], key: bytes) -> dict[str, Any]:
    """``doc`` with its HMAC field set."""
    digest = hmac.new(key, _signed_bytes(doc), hashlib.sha256).hexdigest()
    return {**doc, HMAC_FIELD: {"alg": HMAC_ALG, "key_id": key_id(key), "digest": digest}}


def check_signature(doc: Mapping[str, Any], key: bytes) -> None:
    """Raise UntrustedManifest unless ``doc`` carries a valid HMAC under ``key``."""
    seal = doc.get(HMAC_FIELD)
    if seal is None:
        raise UntrustedManifest(f"{MANIFEST_NAME} is not signed (a checkpoint key is configured)")
    if not isinstance(seal, Mapping) or seal.get("alg") != HMAC_ALG:
        raise UntrustedManifest(f"{MANIFEST_NAME}: '{HMAC_FIELD}' is not an {HMAC_ALG} seal")
    if seal.get("key_id") != key_id(key):
        raise UntrustedManifest(
            f"{MANIFEST_NAME} is signed with another key (key id {_short(seal.get('key_id'))}, "
            f"ours {key_id(key)})"
        )
    digest = seal.get("digest")
    expected = hmac.new(key, _signed_bytes(doc), hashlib.sha256).hexdigest()
    if not isinstance(digest, str) or not hmac.compare_digest(digest, expected):
        raise UntrustedManifest(f"{MANIFEST_NAME}: HMAC does not match (tampered with)")


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the step dir (posix), size, and its
    checksum: ``sha256`` (64 hex digits) or ``crc32`` (8 hex digits), at least one.
    Manifests written before CRC-32 carry ``sha256`` only; they verify as before."""

    path: str
    size: int
    sha256: str | None = None
    crc32: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size}
        if self.sha256 is not None:
            d["sha256"] = self.sha256
        if self.crc32 is not None:
            d["crc32"] = self.crc32
        return d

    @property
    def algorithm(self) -> str:
        """The checksum verification uses: the stronger one listed."""
        return SHA256 if self.sha256 is not None else CRC32

    @property
    def digest(self) -> str:
        return self.sha256 if self.sha256 is not None else self.crc32  # type: ignore[return-value]

    @classmethod
    def from_dict(cls, data: Any) -> FileEntry:
        """Parse and validate; raises CheckpointError naming the bad field."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"file entry must be an object, got {type(data).__name__}")
        path, size = data.get("path"), data.get("size")
        digest, crc = data.get("sha256"), data.get("crc32")
        reason = _unsafe_path_reason(path)
        if reason:
            raise CheckpointError(f"path {path!r} {reason}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{path}: size must be a non-negative integer, got {size!r}")
        if digest is None and crc is None:
            raise CheckpointError(f"{path}: no checksum (sha256 or crc32)")
        if digest is not None and (not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest)):
            raise CheckpointError(f"{path}: sha256 must be 64 lowercase hex digits")
        if crc is not None and (not isinstance(crc, str) or not _CRC32_RE.fullmatch(crc)):
            raise CheckpointError(f"{path}: crc32 must be 8 lowercase hex digits")
        return cls(path=path, size=size, sha256=digest, crc32=crc)


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    created_at: float
    files: tuple[FileEntry, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "files": [f.to_dict() for f in self.files],
            "extra": self.extra,
        }

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Parse and validate a decoded manifest; raises CheckpointError naming the problem."""
        if not isinstance(data, dict):
            raise CheckpointError(f"top level is {_json_type(data)}, expected an object")
        fmt = data.get("format")
        if fmt != FORMAT:
            raise CheckpointError(f"format is {_short(fmt)}, expected {FORMAT!r}")
        version = data.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version != FORMAT_VERSION:
            raise CheckpointError(
                f"unsupported format_version {_short(version)} (this rankguard reads {FORMAT_VERSION})"
            )
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"'step' must be a non-negative integer, got {_short(step)}")
        world_size = data.get("world_size")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise CheckpointError(
                f"'world_size' must be a positive integer, got {_short(world_size)}"
            )
        created_at = data.get("created_at")
        if (
            isinstance(created_at, bool)
            or not isinstance(created_at, (int, float))
            or not math.isfinite(created_at)
        ):
            raise CheckpointError(f"'created_at' must be a unix time, got {_short(created_at)}")
        raw_files = data.get("files")
        if not isinstance(raw_files, list):
            raise CheckpointError(f"'files' must be a list, got {_json_type(raw_files)}")
        files: list[FileEntry] = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_files):
            try:
                entry = FileEntry.from_dict(raw)
            except CheckpointError as e:
                raise CheckpointError(f"files[{i}]: {e}") from None
            if entry.path in seen:
                raise CheckpointError(f"files[{i}]: {entry.path} listed twice")
            seen.add(entry.path)
            files.append(entry)
        extra = data.get("extra", {})
        if not isinstance(extra, dict):
            raise CheckpointError(f"'extra' must be an object, got {_json_type(extra)}")
        return cls(
            step=step,
            world_size=world_size,
            created_at=float(created_at),
            files=tuple(files),
            extra=extra,
        )


@dataclass(frozen=True)
class CheckpointStatus:
    """What one checkpoint directory is. ``reason`` is "" when validated."""

    step: int
    path: Path
    state: str
    reason: str
    size_bytes: int
    world_size: int | None = None
    created_at: float | None = None
    extra: dict[str, Any] | None = None
    #: for quarantined entries: the state it had when moved aside ("incomplete"/"corrupt"/...).
    original_state: str | None = None

    @property
    def is_quarantined(self) -> bool:
        # step dirs have canonical names; quarantine entries carry a timestamp suffix
        return parse_step_dir_name(self.path.name) is None

    @property
    def is_partial(self) -> bool:
        parsed = parse_step_dir_name(self.path.name)
        return parsed is not None and parsed[1]

    @property
    def is_committed(self) -> bool:
        """A ``step-N`` dir at the root (whatever its state): it claims to be a checkpoint."""
        parsed = parse_step_dir_name(self.path.name)
        return parsed is not None and not parsed[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "state": self.state,
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "original_state": self.original_state,
            "extra": self.extra,
        }
