"""`rankguard up` against another local user: its rendezvous store runs nothing another uid
writes into it, its run directory is its own, and its checkpoints are keyed by default.

The attacker is a real second uid (`setpriv`, uid 65534), on loopback only; these need
root (the CI suite runs as root)."""

from __future__ import annotations

import base64
import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from up_run import Up

NOBODY = 65534
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as a second local user needs root and setpriv (the CI suite runs as root)",
)


def up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "up", *args],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")},
    )  # fmt: skip


def refused(proc: subprocess.CompletedProcess, why: str) -> None:
    """Exit 2, one line saying why, and nothing started (no traceback, no daemon log)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0], proc.stderr
    assert "rankguard up: run" not in proc.stdout


# ------------------------------------------------------------------- the run directory


def test_a_run_directory_prepared_by_another_user_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "faults").write_text("kill:rank=0:step=4\n")
    os.chown(run, NOBODY, NOBODY)
    os.chown(run / "faults", NOBODY, NOBODY)
    refused(up(tmp_path, "--run-dir", str(run), "--steps", "5"), "owned by uid 65534")
    assert sorted(p.name for p in run.iterdir()) == ["faults"]  # nothing written there


def test_a_world_writable_run_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    refused(up(tmp_path, "--run-dir", str(run), "--steps", "5"), "writable by group or others")
    assert list(run.iterdir()) == []


def test_a_checkpoint_root_of_another_user_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.chown(ckpt, NOBODY, NOBODY)
    proc = up(tmp_path, "--run-dir", str(tmp_path / "run"), "--ckpt-dir", str(ckpt))
    refused(proc, "--ckpt-dir: ")


def test_a_symlinked_log_in_the_users_own_run_directory_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "trainer.log").symlink_to(victim)
    refused(up(tmp_path, "--run-dir", str(run), "--steps", "5"), "symbolic links (trainer.log)")
    assert victim.read_text() == "precious\n"


def test_a_fault_file_another_user_can_write_is_not_obeyed(tmp_path):
    from rankguard.trainer.faults import FaultInjector

    faults = tmp_path / "faults"
    faults.write_text("slow:step=0:factor=3\n")
    injector = FaultInjector((), rank=0, restart_count=0, fault_file=str(faults))
    faults.chmod(0o666)
    injector.poll_file()
    assert injector.specs == []
    faults.chmod(0o600)
    os.chown(faults, NOBODY, NOBODY)
    faults.write_text("slow:step=0:factor=4\n")  # a new mtime: read again, still refused
    injector.poll_file()
    assert injector.specs == []
    os.chown(faults, 0, 0)
    faults.write_text("slow:step=0:factor=5\n")
    injector.poll_file()
    assert [s.factor for s in injector.specs] == [5.0]


# ------------------------------------------------------- the rendezvous store, attacked

ATTACK = """
import base64, sys, time
from datetime import timedelta
import torch.distributed as dist
port, key, forged = int(sys.argv[1]), sys.argv[2], base64.b64decode(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
for value in (forged, b"this is not a rendezvous state"):
    store.set(key, value)
    time.sleep(3)
print("written")
"""


class Touch:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_up_a_forged_rendezvous_state_from_another_uid_runs_nothing_and_the_job_goes_on(
    tmp_path, monkeypatch
):
    """The attack of the issue: another uid rewrites torchrun's rendezvous state in the
    store of a running `rankguard up` with a crafted pickle, then with garbage. Nothing
    runs, the job is not ended, the refusals are counted; the store listens on loopback
    only; the run directory and its secrets are the user's alone; checkpoints are keyed."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    drop = Path(tempfile.mkdtemp(prefix="rg-drop-"))  # where a forged pickle would write
    drop.chmod(0o777)
    marker = drop / "ran"
    run = Up(tmp_path, "--steps", "500", "--ckpt-every", "50")
    try:
        run.agent_url()
        port = int(re.search(r"\| rendezvous 127\.0\.0\.1:(\d+)", "".join(run.out)).group(1))
        ss = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
        assert [line.split()[3] for line in ss.stdout.splitlines()] == [f"127.0.0.1:{port}"]
        deadline = time.monotonic() + 120
        while "step" not in (run.run / "trainer.log").read_text():  # training has begun
            assert time.monotonic() < deadline and run.proc.poll() is None, run.output()
            time.sleep(0.2)
        forged = base64.b64encode(base64.b64encode(pickle.dumps(Touch(str(marker))))).decode()
        attack = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sys.executable, "-I", "-c", ATTACK, str(port), "torch.rendezvous.run", forged],
            capture_output=True, text=True, timeout=120, env={"HOME": str(drop)},
        )  # fmt: skip
        assert attack.returncode == 0 and "written" in attack.stdout, attack.stderr[-2000:]
        assert run.wait(timeout=600) == 0, run.output()[-4000:]
    finally:
        run.close()
        shutil.rmtree(drop, ignore_errors=True)
    assert not marker.exists(), "the forged rendezvous state was unpickled"
    assert "training completed: step 500" in run.output()
    log = (run.run / "trainer.log").read_text()
    counts = [int(n) for n in re.findall(r"failed its signature.*?\((\d+) refused so far", log)]
    assert counts and max(counts) >= 1, log[-3000:]
    # the run's files are the user's alone
    assert stat.S_IMODE(run.run.stat().st_mode) == 0o700
    for name in ("token", "rendezvous.key", "faults", "trainer.log", "agent.log"):
        assert stat.S_IMODE((run.run / name).stat().st_mode) == 0o600, name
    # and its checkpoints carry the user's key, made at first use
    key = tmp_path / "config" / "rankguard" / "checkpoint.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    manifests = sorted((run.run / "ckpt").glob("step-*/manifest.json"))
    assert manifests and all('"hmac"' in m.read_text() for m in manifests)


def test_up_refuses_a_planted_checkpoint_before_unpickling_and_resumes_its_own(tmp_path):
    """A self-consistent checkpoint planted in the root (an unkeyed manifest over a crafted
    DCP .metadata pickle) is refused by default; the run resumes from its own, keyed ones."""
    import hashlib
    import json

    ckpt = tmp_path / "ckpt"
    first = up(tmp_path, "--run-dir", str(tmp_path / "run1"), "--ckpt-dir", str(ckpt),
               "--steps", "40", "--ckpt-every", "20")  # fmt: skip
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    marker = tmp_path / "unpickled"
    forged = ckpt / "step-00000090"
    forged.mkdir()
    data = pickle.dumps(Touch(str(marker)))
    (forged / ".metadata").write_bytes(data)
    doc = {"format": "rankguard-checkpoint", "format_version": 1, "step": 90, "world_size": 2,
           "created_at": 1.0, "extra": {}, "files": [{"path": ".metadata", "size": len(data),
           "sha256": hashlib.sha256(data).hexdigest()}]}  # fmt: skip
    (forged / "manifest.json").write_text(json.dumps(doc))
    second = up(tmp_path, "--run-dir", str(tmp_path / "run2"), "--ckpt-dir", str(ckpt),
                "--steps", "60", "--ckpt-every", "20")  # fmt: skip
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert not marker.exists(), "the planted checkpoint was unpickled"
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert summary["resumed_from"] == 40 and summary["final_step"] == 60, summary
