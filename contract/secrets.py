"""Secret files (tokens, keys): created secret in one step, read only when still secret.

Standard library only: the agent, the supervisor, the CLI and the rank-side client share
these. A secret is never written and then chmod-ed (a reader spinning on the path would
open it in between), and never written through a symbolic link someone else planted.
"""

from __future__ import annotations

import os
import secrets
import stat


class SecretFileError(ValueError):
    """A secret file that is missing, not a regular file, readable by others, or too short;
    the message is one line that says what to do."""


def private_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` (an existing directory) is not the user's own, or None: a symbolic link,
    not a directory, owned by another user, or writable by group or others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def write_secret_file(path: str | os.PathLike[str], secret: str | bytes) -> None:
    """Create `path` holding `secret`, mode 0600 from its first instant (O_EXCL: a file
    already there is replaced only by unlinking it first, O_NOFOLLOW: a planted link is
    never written through). The caller chooses a directory only its owner can enter."""
    data = secret.encode() if isinstance(secret, str) else secret
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)  # a leftover of an earlier run (or a link): gone, then created anew
        fd = os.open(path, flags, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def new_secret_file(path: str | os.PathLike[str]) -> str:
    """A fresh random secret (256 bits, URL-safe text) written to `path`; returns it."""
    secret = secrets.token_urlsafe(32)
    write_secret_file(path, secret)
    return secret


def read_secret_file(
    path: str | os.PathLike[str], what: str, min_length: int = 16, strip=bytes.strip
) -> bytes:
    """The secret in `path` less surrounding whitespace (`strip`: checkpoint keys keep
    leading bytes, as they always did): a regular file only its owner can read, at least
    `min_length` bytes. SecretFileError with a one-line reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SecretFileError(f"{what} file {path} is not a regular file")
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecretFileError(
                    f"{what} file {path} is accessible by group or others (mode "
                    f"{stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}"
                )
            data = strip(os.read(fd, 64 * 1024))
        finally:
            os.close(fd)
    except OSError as exc:
        raise SecretFileError(f"{what} file {path}: {exc.strerror or exc}") from None
    if len(data) < min_length:
        raise SecretFileError(
            f"{what} file {path}: shorter than {min_length} bytes (make one with: "
            f"(umask 077; head -c 32 /dev/urandom | base64 > {path}))"
        )
    return data
