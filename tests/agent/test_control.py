"""The agent's control actions on ranks (agent/control.py): what a kill reaches."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from test_discovery import _found

from rankguard.agent.control import (
    ControlError,
    descendants,
    send_signal,
    stop_job,
    write_save_request,
)
from rankguard.agent.ranks import RankTable
from rankguard.client import Reporter
from rankguard.contract import exit_codes

# A rank with a DataLoader-like worker blocked in a read (it never notices its parent's
# death), which has a child of its own.
PARENT = """
import subprocess, sys, time
inner = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", inner])
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_sigkill_of_a_rank_ends_what_it_started_and_other_signals_do_not():
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        deadline = time.monotonic() + 30
        while len(tree := descendants(proc.pid)) < 2:
            assert time.monotonic() < deadline, tree
            time.sleep(0.05)
        with RankTable() as table:
            table.adopt(_found(proc))
            send_signal(table, {"job": "job", "rank": 1, "signal": "SIGCONT"})
            assert all(_alive(p) for p in tree)
            out = send_signal(table, {"job": "job", "rank": 1, "signal": "SIGKILL"})
            assert sorted(out["descendants"]) == sorted(tree)
            proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while any(_alive(p) for p in tree):
                assert time.monotonic() < deadline, [p for p in tree if _alive(p)]
                time.sleep(0.05)
    finally:
        for pid in descendants(proc.pid):  # a failed check leaves them: end them by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_a_save_request_reaches_the_jobs_reporter_and_only_for_its_step_and_incarnation(tmp_path):
    """The agent writes the supervisor's request beside its socket, readable by any user;
    the job's Reporter of that incarnation saves at that step only; a withdrawal, another
    incarnation or a garbled file asks nothing; a job without ranks here is refused."""
    sock = str(tmp_path / "telemetry.sock")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with RankTable() as table:
            table.adopt(_found(proc, job="job", restart=2))
            with pytest.raises(ControlError) as refused:
                write_save_request(table, sock, {"job": "other", "restart": 0, "step": 5})
            assert refused.value.status == 404
            for bad in ({"job": "job", "restart": 2, "step": "soon"}, {"job": "job"}):
                with pytest.raises(ControlError) as refused:
                    write_save_request(table, sock, bad)
                assert refused.value.status == 400 and "bad save request" in str(refused.value)
            out = write_save_request(table, sock, {"job": "job", "restart": 2, "step": 40})
            assert (out["step"], out["ranks"]) == (40, [1])
            assert os.stat(out["path"]).st_mode & 0o777 == 0o644
            assert os.listdir(os.path.dirname(out["path"])) == [os.path.basename(out["path"])]

            def asked(restart: int, step: int) -> bool:
                rg = Reporter(job="job", socket_path=sock, restart=restart, flight_recorder=False)
                try:
                    return rg.save_requested(step)
                finally:
                    rg.close()

            assert asked(2, 40) and not asked(2, 39) and not asked(2, 41)
            assert not asked(1, 40)  # the incarnation before: not its request
            out = write_save_request(table, sock, {"job": "job", "restart": 2, "step": None})
            assert out["withdrawn"] and not os.path.exists(out["path"]) and not asked(2, 40)
            with open(out["path"], "w") as f:
                f.write("{not json")
            rg = Reporter(job="job", socket_path=sock, restart=2, flight_recorder=False)
            assert not rg.save_requested(40) and rg.errors.get("save_request") == 1
            rg.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_save_request_is_never_written_through_a_link(tmp_path):
    """The requests' folder beside the socket must be the agent's own: a link planted
    there (to /etc, say) is refused, and nothing is written where it points."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "sock").mkdir()
    (tmp_path / "sock" / "save-requests").symlink_to(elsewhere)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with RankTable() as table:
            table.adopt(_found(proc, job="job"))
            with pytest.raises(ControlError) as refused:
                write_save_request(table, str(tmp_path / "sock" / "telemetry.sock"),
                                   {"job": "job", "restart": 0, "step": 9})  # fmt: skip
            assert refused.value.status == 500 and "agent's own" in str(refused.value)
        assert list(elsewhere.iterdir()) == []
    finally:
        proc.kill()
        proc.wait()


def test_stop_job_leaves_the_cause_for_the_launcher_before_it_signals(tmp_path):
    """The supervisor's stop carries the incident's cause: the agent writes it beside the
    socket (the launcher's exit code comes from it) and only then signals. A malformed
    status is refused whole: nothing is written and nothing signalled."""
    sock = str(tmp_path / "telemetry.sock")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with RankTable() as table:
            table.adopt(_found(proc, job="job"))
            for bad in ({"cause": "cosmic_rays", "confidence": "high", "why": "", "action": "x",
                         "incident": 1}, "gpu", {"cause": "gpu"}):  # fmt: skip
                with pytest.raises(ControlError) as refused:
                    stop_job(table, sock, {"job": "job", "status": bad})
                assert refused.value.status == 400, bad
            assert not exit_codes.status_path(sock, "job").exists() and proc.poll() is None
            status = {"cause": "gpu", "confidence": "high", "why": "XID 79: fallen off the bus",
                      "action": "exclude_node", "incident": 7}  # fmt: skip
            before = time.time()
            out = stop_job(table, sock, {"job": "job", "status": status})
            assert out["ranks_signalled"] == [proc.pid]
            assert proc.wait(timeout=10) == -signal.SIGTERM
            found = exit_codes.read_status(sock, "job", since=before)
            assert found is not None and (found.cause, found.incident) == ("gpu", 7), found
            assert found.exit_code == exit_codes.INFRASTRUCTURE
            assert exit_codes.read_status(sock, "job", since=time.time() + 1) is None  # older
            assert exit_codes.read_status(sock, "other", since=before) is None
    finally:
        proc.kill()
        proc.wait()


def test_a_reporter_reads_the_request_at_most_twice_a_second(tmp_path, monkeypatch):
    sock = str(tmp_path / "telemetry.sock")
    rg = Reporter(job="job", socket_path=sock, restart=0, flight_recorder=False)
    reads = []
    monkeypatch.setattr(rg, "_read_save_request", lambda: reads.append(1) or 7)
    try:
        assert [rg.save_requested(s) for s in (6, 7, 8, 7)] == [False, True, False, True]
        assert len(reads) == 1  # four steps within half a second: one read
    finally:
        rg.close()
