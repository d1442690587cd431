"""`rankguard checkpoints` shows what another user named, never runs it on the terminal:
names and reasons from a root's files, manifests, quarantine records and backup status
are printed with their control characters escaped; `--json` stays exact JSON. Real
files, the real command line in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from builders import make_ckpt

from rankguard.cli.checkpoints import printable
from rankguard.client import checkpoint_store as cs

RANKGUARD = [sys.executable, "-m", "rankguard.cli.main"]
CLEAR = "\x1b[2J"  # clears the screen
TITLE = "\x1b]0;owned\x07"  # sets the window title
FORGED_LINE = "newest checkpoint step 99 is validated"


def test_printable_escapes_control_characters_only():
    assert printable("step-00000010 ok: é ✓") == "step-00000010 ok: é ✓"
    assert printable(f"a{CLEAR}b") == r"a\x1b[2Jb"
    assert printable("x\ny\tz\u202e\udcff\x7f") == r"x\ny\tz\u202e\udcff\x7f"
    assert printable(None) == "None"


def _hostile_root(tmp_path: Path) -> Path:
    """A root whose files carry escape sequences: step 10 good, step 20 listing a file named
    CLEAR at the wrong size beside an unlisted TITLE file and an undecodable name, a
    quarantined step with a forged record, and a failing backup tier's status."""
    root = tmp_path / "ckpt"
    make_ckpt(root, 10)
    d = root / cs.step_dir_name(20)
    d.mkdir()
    (d / CLEAR).write_bytes(b"x" * 10)
    (d / TITLE).write_bytes(b"y")
    os.close(os.open(os.fsencode(d) + b"/bad\xff", os.O_CREAT | os.O_WRONLY, 0o600))
    doc = {"format": cs.FORMAT, "format_version": cs.FORMAT_VERSION, "step": 20,
           "world_size": 1, "created_at": 1.0, "extra": {},
           "files": [{"path": CLEAR, "size": 99, "sha256": "0" * 64}]}  # fmt: skip
    (d / cs.MANIFEST_NAME).write_text(json.dumps(doc))
    q = root / cs.QUARANTINE_DIRNAME / "step-00000005.20240101T000000Z"
    q.mkdir(parents=True)
    record = {"reason": f"{CLEAR}red\n{FORGED_LINE}", "state": TITLE, "original": "step-00000005"}
    (q / cs.QUARANTINE_RECORD).write_text(json.dumps(record))
    backup = tmp_path / f"backup{CLEAR}"
    backup.mkdir()
    status = {"backup_root": str(backup), "failing": True, "consecutive_failures": CLEAR,
              "copies_failed": 3, "last_error": f"{TITLE}disk full"}  # fmt: skip
    (root / cs.BACKUP_STATUS_NAME).write_text(json.dumps(status))
    return root


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RANKGUARD, "checkpoints", *args], capture_output=True, timeout=120)


def test_list_shows_a_checkpoints_names_escaped(tmp_path):
    root = _hostile_root(tmp_path)
    proc = _run("list", str(root))
    out = proc.stdout.decode()
    assert b"\x1b" not in proc.stdout + proc.stderr and b"\x07" not in proc.stdout, out
    assert proc.returncode == 1, (out, proc.stderr)  # degraded: 20 is corrupt, 10 is good
    # every name is there, escaped: nothing was dropped to make the output clean
    for shown in (r"\x1b[2J: size 10 != manifest 99", r"\x1b]0;owned\x07: not listed",
                  r"bad\udcff", r"\x1b[2Jred\nnewest checkpoint step 99",
                  r"quarantined (\x1b]0;owned\x07)", r"backup\x1b[2J",
                  r"BACKUP FAILING: \x1b[2J consecutive", r"last: \x1b]0;owned\x07disk full"):  # fmt: skip
        assert shown in out, (shown, out)
    assert not any(line.startswith(FORGED_LINE) for line in out.splitlines())
    assert "DEGRADED: newest checkpoint step 20 is not valid" in out


def test_list_json_keeps_the_names_exact(tmp_path):
    root = _hostile_root(tmp_path)
    proc = _run("list", str(root), "--json")
    assert b"\x1b" not in proc.stdout  # json escapes it (\u001b)
    doc = json.loads(proc.stdout)
    reasons = {c["step"]: c["reason"] for c in doc["checkpoints"]}
    assert reasons[20].startswith(f"{CLEAR}: size 10 != manifest 99")
    assert reasons[5] == f"{CLEAR}red\n{FORGED_LINE}"
    assert doc["backup_status"]["last_error"] == f"{TITLE}disk full"


def test_an_error_naming_a_hostile_path_is_escaped(tmp_path):
    missing = tmp_path / f"gone{CLEAR}"
    proc = _run("verify", str(missing))
    assert proc.returncode == 2 and b"\x1b" not in proc.stdout + proc.stderr
    assert (
        proc.stderr.decode().strip()
        == rf"error: checkpoint directory {tmp_path}/gone\x1b[2J does not exist"
    )
