"""Secret files: created with their final mode in one step, read only while still secret,
and directories judged the user's own. The race is run against a real second uid."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rankguard.contract.secrets import (
    SecretFileError,
    new_secret_file,
    private_dir_problem,
    read_secret_file,
    write_secret_file,
)

NOBODY = 65534
as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as a second local user needs root and setpriv (the CI suite runs as root)",
)


def test_a_new_secret_is_owner_only_and_read_back(tmp_path):
    path = tmp_path / "token"
    secret = new_secret_file(path)
    assert len(secret) >= 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_secret_file(path, "token") == secret.encode()
    assert new_secret_file(path) != secret  # a leftover is replaced, not reused


def test_a_planted_link_is_replaced_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "token").symlink_to(victim)
    write_secret_file(tmp_path / "token", "s" * 32)
    assert victim.read_text() == "precious"
    assert not (tmp_path / "token").is_symlink()


@pytest.mark.parametrize(
    ("mode", "content", "reason"),
    [(0o640, "s" * 32, "accessible by group or others"), (0o600, "short", "shorter than 16")],
)
def test_a_loose_or_short_secret_is_refused(tmp_path, mode, content, reason):
    path = tmp_path / "key"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(SecretFileError, match=reason):
        read_secret_file(path, "key")


def test_a_directory_is_the_users_own_only_when_no_one_else_can_write_it(tmp_path):
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    assert private_dir_problem(own) is None
    own.chmod(0o777)
    assert "writable by group or others" in private_dir_problem(own)
    (tmp_path / "link").symlink_to(own)
    assert "symbolic link" in private_dir_problem(tmp_path / "link")
    if os.geteuid() == 0:
        os.chown(own, NOBODY, NOBODY)
        own.chmod(0o700)
        assert "owned by uid 65534" in private_dir_problem(own)


SPINNER = """
import os, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
opened = denied = 0
print("ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        os.close(os.open(path, os.O_RDONLY))
        opened += 1
    except PermissionError:
        denied += 1
    except OSError:
        pass
print(opened, denied)
"""


@as_root
def test_a_reader_of_another_uid_spinning_on_the_path_never_opens_a_new_secret():
    """A world-traversable folder (the worst case: `up` makes its run directory 0700 as
    well), the secret created 400 times while another uid tries to open it without pause."""
    folder = Path(tempfile.mkdtemp(prefix="rg-secret-"))
    try:
        folder.chmod(0o755)
        path = folder / "token"
        spinner = subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sys.executable, "-I", "-S", "-c", SPINNER, str(path), "4"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert spinner.stdout.readline().strip() == "ready"
        end = time.monotonic() + 3
        starts = 0
        while time.monotonic() < end or starts < 400:
            new_secret_file(path)
            starts += 1
        opened, denied = map(int, spinner.communicate(timeout=30)[0].split())
        assert denied > 0, "the reader never found the file: the race was not run"
        assert opened == 0, f"another uid opened the secret {opened} times"
    finally:
        shutil.rmtree(folder)
