"""`rankguard launch -- CMD`: CMD's outcome as an exit code a job controller retries by.

Here CMD stands in for torchrun, and where a test needs the agent's status file the
command writes it itself while it runs, as the agent does before it stops torchrun (the
agent's side: tests/agent/test_control.py; the two together under `rankguard up`:
test_up_exit_codes.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from rankguard.cli.launch import job_of
from rankguard.contract import exit_codes

LAUNCH = [sys.executable, "-m", "rankguard.cli.main", "launch"]

WRITE_STATUS = """
import sys, time
from rankguard.contract import exit_codes as e
path = e.status_path(sys.argv[1], "job1")
path.parent.mkdir(exist_ok=True)
path.write_bytes(e.encode(e.JobStatus("job1", sys.argv[2], "high", "XID 79", "exclude_node", 4,
                                      time.time())))
sys.exit(1)  # torchrun's code for a failed worker, whatever the cause
"""


def _launch(tmp_path, *command: str, job: str = "job1") -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAUNCH, "--job", job, "--telemetry-socket", str(tmp_path / "telemetry.sock"),
         "--termination-log", str(tmp_path / "termination-log"), "--", *command],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_stopped_jobs_cause_becomes_the_exit_code_and_the_termination_message(tmp_path):
    sock = str(tmp_path / "telemetry.sock")
    for cause, ended in (("gpu", exit_codes.INFRASTRUCTURE), ("user_code", exit_codes.USER_ERROR)):
        proc = _launch(tmp_path, sys.executable, "-c", WRITE_STATUS, sock, cause)
        assert proc.returncode == ended.code, proc.stderr
        message = json.loads((tmp_path / "termination-log").read_text())
        assert (message["exit_code"], message["name"], message["cause"], message["incident"]) == (
            ended.code, ended.name, cause, 4), message  # fmt: skip
        assert f"cause {cause}" in proc.stderr


def test_without_a_status_of_this_run_the_launchers_code_stays(tmp_path):
    sock = str(tmp_path / "telemetry.sock")
    path = exit_codes.status_path(sock, "job1")
    path.parent.mkdir()
    path.write_bytes(exit_codes.encode(
        exit_codes.JobStatus("job1", "gpu", "high", "", "exclude_node", 1, time.time() - 60)))  # fmt: skip
    proc = _launch(tmp_path, "sh", "-c", "exit 1")  # the status is an earlier run's
    assert proc.returncode == 1 and "recorded no cause" in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "termination-log").read_text())["exit_code"] == 1
    assert _launch(tmp_path, "sh", "-c", "exit 0").returncode == 0
    assert _launch(tmp_path, "sh", "-c", "kill -KILL $$").returncode == 128 + 9


def test_a_signal_is_passed_on_and_ends_with_its_code(tmp_path):
    marker = tmp_path / "got-term"
    script = f"trap 'touch {marker}; exit 143' TERM; while true; do sleep 0.1; done"
    proc = subprocess.Popen([*LAUNCH, "--job", "j", "--telemetry-socket", str(tmp_path / "s"),
                             "--", "sh", "-c", script], stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        time.sleep(2)  # python and the shell have started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == exit_codes.TERMINATED.code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert marker.exists()  # the command got the SIGTERM


def test_bad_invocations_are_refused_with_code_2(tmp_path):
    no_job = subprocess.run([*LAUNCH, "--", "sh", "-c", "exit 0"], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert no_job.returncode == 2 and "--rdzv-id" in no_job.stderr
    missing = _launch(tmp_path, str(tmp_path / "no-such-launcher"))
    assert missing.returncode == 2 and "cannot run" in missing.stderr


def test_the_job_is_torchruns_rendezvous_id():
    assert job_of(["torchrun", "--rdzv-id", "a", "x.py"]) == "a"
    assert job_of(["torchrun", "--rdzv_id=b", "x.py"]) == "b"
    assert job_of(["torchrun", "x.py", "--rdzv-id"]) is None
