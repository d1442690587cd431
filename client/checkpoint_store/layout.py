"""The checkpoint root's names and constants: file and directory names, the manifest format,
states, checksum names, step-directory names, the store's errors, and small text helpers."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

MANIFEST_NAME = "manifest.json"
MANIFEST_TMP_NAME = "manifest.json.tmp"
QUARANTINE_DIRNAME = "quarantine"
QUARANTINE_RECORD = "QUARANTINE.json"
FORMAT = "rankguard-checkpoint"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
DEFAULT_CHUNK = 8 * 1024 * 1024
INCARNATION_FILE = "incarnation"  # the job's incarnation number, in the root
#: the tiers a resume reads, fastest first: this root (tier 1), a backup root (tier 2)
TIER_DISK, TIER_BACKUP = "disk", "backup"
#: the manifest field holding its HMAC when a checkpoint key is configured
HMAC_FIELD = "hmac"
HMAC_ALG = "hmac-sha256"
#: where a checkpoint key file is named when no argument names one
KEY_FILE_ENV = "RANKGUARD_CHECKPOINT_KEY_FILE"
MIN_KEY_BYTES = 16
_MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # far above any real manifest, far below a memory problem
_MAX_SMALL_FILE = 1024 * 1024  # QUARANTINE.json, incarnation
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under a listed name must not block the reader forever
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

VALIDATED = "validated"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
QUARANTINED = "quarantined"
STATES = (VALIDATED, INCOMPLETE, CORRUPT, QUARANTINED)

#: ``step-00000020`` (committed) or ``step-00000020.partial``; group 1 = digits, 2 = suffix.
STEP_DIR_RE = re.compile(r"^step-(\d{8,})(\.partial)?$")
_QUARANTINE_ENTRY_RE = re.compile(r"^(step-\d{8,}(?:\.partial)?)\.")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CRC32_RE = re.compile(r"^[0-9a-f]{8}$")
# File checksums. Without a key the checksum is there to catch corruption (a torn write, a
# flipped bit, a truncated copy), and CRC-32 does that at twice SHA-256's speed here (both
# release the GIL on large buffers). With a key, tampering is the threat: a forged file
# with the same CRC-32 is trivial, so keyed manifests list SHA-256 sums only.
SHA256, CRC32 = "sha256", "crc32"
CHECKSUMS = (SHA256, CRC32)


def checksum_for(key: bytes | None) -> str:
    """The checksum a new manifest uses: SHA-256 with a key (tamper-evident), else CRC-32."""
    return SHA256 if key is not None else CRC32


_RESERVED = frozenset({MANIFEST_NAME, MANIFEST_TMP_NAME})

Progress = Callable[[int, int], None]


class CheckpointError(Exception):
    """A checkpoint operation was refused or a checkpoint cannot be used (message says why)."""


class UntrustedManifest(CheckpointError):
    """A manifest whose HMAC is missing, of another key, or wrong while a key is configured:
    the checkpoint may have been tampered with, so it is judged corrupt and never loaded."""


# --------------------------------------------------------------------------- names


def step_dir_name(step: int) -> str:
    """``step-%08d``: the committed directory name of ``step``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    return f"step-{step:08d}"


def parse_step_dir_name(name: str) -> tuple[int, bool] | None:
    """``(step, is_partial)`` for a canonical step dir name, else None."""
    m = STEP_DIR_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    if m.group(1) != f"{step:08d}":  # non-canonical (e.g. extra leading zeros): not ours
        return None
    return step, m.group(2) is not None


def _unsafe_path_reason(path: Any) -> str:
    if not isinstance(path, str) or not path:
        return "must be a non-empty string"
    if "\x00" in path or "\\" in path:
        return "contains a NUL or backslash"
    if path.startswith("/"):
        return "is absolute"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "is not a normalized relative path"
    if path in _RESERVED:
        return "is a reserved name"
    return ""


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number" if isinstance(v, (int, float)) else type(v).__name__
    )


def _short(v: Any, limit: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."
