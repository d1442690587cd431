"""A checkpoint filesystem that fills up mid-run: training goes on, nothing bogus is
validated, and saves validate again once space is freed (a real tmpfs, real torchrun)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import read_json, trainer_command

pytestmark = pytest.mark.slow


@pytest.fixture
def small_fs(tmp_path):
    """A 32 MiB tmpfs of our own: filling it touches nothing else."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "ckfs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem says ENOSPC; returns it."""
    filler = directory / "filler"
    chunk = b"\0" * (256 * 1024)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_full_checkpoint_disk_mid_run_training_completes_and_saves_resume(tmp_path, small_fs):
    root, log = small_fs / "ckpt", tmp_path / "train.log"
    cmd, env = trainer_command(
        ["--steps", "400", "--ckpt-dir", str(root), "--ckpt-every", "10", "--keep", "3",
         "--summary", str(tmp_path / "s.json")],
    )  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: (root / "step-00000020").is_dir(), 120, "step 20 validated")
        filler = fill(small_fs)

        def failed_saves() -> int:
            text = log.read_text()
            return text.count("not committed") + text.count("skipped")

        wait_for(lambda: failed_saves() >= 2 or proc.poll() is not None, 60, "a failed save")
        assert proc.poll() is None, log.read_text()[-4000:]  # still training
        filler.unlink()  # space returns
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    s = read_json(tmp_path / "s.json")
    assert s["final_step"] == 400 and s["checkpoint_failures"] >= 1
    assert s["newest_validated_checkpoint"] == 400  # saves validate again by themselves
    report = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "checkpoints", "verify", "--json", str(root)],
        capture_output=True, text=True,
    )  # fmt: skip
    doc = json.loads(report.stdout)
    assert report.returncode == 0, doc
    bogus = [c for c in doc["checkpoints"] if c["state"] in ("incomplete", "corrupt")]
    assert not bogus, bogus  # failed saves were quarantined once a later step committed
    assert any(c["state"] == "quarantined" for c in doc["checkpoints"]), doc
