"""`rankguard up` fails fast on a run that cannot work: its own and the bundled trainer's
arguments are checked before anything starts (exit 2, one line, no run directory), and
workers that fail at start by themselves (an argument error, an import error) end the
job at once (exit 1, their own error on screen), unrestarted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from up_run import left_running

from rankguard.cli.up import last_error, last_traceback
from rankguard.contract import exit_codes
from rankguard.contract import startup_guard as sg

UP = [sys.executable, "-m", "rankguard.cli.main", "up"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args,words",
    [
        (["--steps", "-5"], ["--steps must be >= 1"]),
        (["--steps", "0"], ["--steps must be >= 1"]),
        (["--nproc", "0"], ["--nproc 0", "1 or more"]),
        (["--preset", "huge"], ["--preset", "'huge'", "tiny"]),
        (["--trainer-arg=--bogus"], ["--bogus", "(--trainer-arg)"]),
    ],
    ids=["steps-negative", "steps-zero", "nproc-zero", "preset-unknown", "trainer-arg"],
)
def test_a_bad_argument_is_one_line_before_anything_starts(tmp_path, args, words):
    run = tmp_path / "run"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = subprocess.run([*UP, "--run-dir", str(run), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "300"})  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err, proc.stdout)
    assert "\n" not in err and "Traceback" not in err and err.startswith("rankguard up:"), err
    for word in words:
        assert word in err, err
    assert proc.stdout == ""  # no run line: nothing was started
    assert not run.exists()  # no run directory
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# the guard's rule, as data
E = sg.Exit


@pytest.mark.parametrize(
    "exits,restart,culprit",
    [
        ([E(1, 0, 11, False, 3.0), E(0, 0, 10, False, 3.2)], 0, 1),  # both failed at start
        ([E(0, 0, 10, False, 3.0)], 0, 0),  # one failed; its peer was ended by torchrun
        ([E(0, 0, 10, True, 3.0), E(1, 0, 11, False, 3.0)], 0, None),  # a group formed
        ([E(0, 0, 10, False, sg.STARTUP_SECONDS + 1)], 0, None),  # it worked for a while
        ([E(0, 1, 10, False, 3.0)], 1, None),  # a later incarnation: the crash-loop guard's
        ([], 0, None),  # killed (no exit of its own): a fault, restarted
    ],
)
def test_startup_failure_rule(exits, restart, culprit):
    found = sg.startup_failure(exits, restart)
    assert (found.rank if found else None) == culprit


def test_guard_lines_round_trip_and_torn_lines_are_skipped():
    text = sg.exit_line(1, 0, 42, False, 2.5) + '{"rank": 0, "resta' + "\n"
    assert sg.parse(text) == [E(1, 0, 42, False, 2.5)]


def test_last_error_is_the_workers_not_torchruns():
    argparse_log = (
        "usage: ddp_plain.py [-h] [--steps STEPS]\n"
        "ddp_plain.py: error: unrecognized arguments: --stepz 10\n"
        'Traceback (most recent call last):\n  File "torchrun", line 1, in <module>\n'
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert last_error(argparse_log) == "ddp_plain.py: error: unrecognized arguments: --stepz 10"
    teardown = (
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
        "ValueError: bad shard\n"
        'Traceback (most recent call last):\n  File "api.py", line 9, in _terminate\n'
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15\n"
    )
    assert last_traceback(teardown).endswith("ValueError: bad shard")
    assert last_error(teardown).endswith("ValueError: bad shard")
    assert last_error("all good\n") is None


def _no_process_left(run: Path, pids: set[int]) -> None:
    """Nothing up started is still running: no worker of the guard file (by PID) and no
    process with this run's telemetry socket in its environment (daemons, torchrun)."""
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert alive == [] and left_running(run) == [], (alive, left_running(run))


def _up_script(tmp_path: Path, script: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    run = tmp_path / "run"
    proc = subprocess.run([*UP, "--nproc", "2", "--run-dir", str(run), "--", *script],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    return proc, run


def _ended_at_start(proc, run: Path) -> list[sg.Exit]:
    assert proc.returncode == exit_codes.USER_ERROR.code, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed at start" in proc.stderr and "not restarted" in proc.stderr, proc.stderr
    assert "crash loop" not in proc.stderr and "SignalException" not in proc.stderr
    exits = sg.read(run / "worker-exits.jsonl")
    assert exits and all(e.restart == 0 for e in exits), exits  # one incarnation
    _no_process_left(run, {e.pid for e in exits})
    return exits


@pytest.mark.slow
def test_a_scripts_argument_error_ends_the_job_with_its_message(tmp_path):
    proc, run = _up_script(tmp_path, ["examples/ddp_plain.py", "--stepz", "10"])
    _ended_at_start(proc, run)
    assert "the script's last error:\nddp_plain.py: error: unrecognized arguments: --stepz 10" in (
        proc.stderr
    ), proc.stderr
    log = (run / "trainer.log").read_text()
    assert log.count("error: unrecognized arguments") <= 2  # each rank once: no restart


@pytest.mark.slow
def test_a_script_that_fails_at_import_ends_the_job_with_its_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("raise ImportError('cannot import name shard_loader from data')\n")
    proc, run = _up_script(tmp_path, [str(script)])
    _ended_at_start(proc, run)
    err = proc.stderr
    assert "the script's last error:\nTraceback (most recent call last):" in err, err
    assert "ImportError: cannot import name shard_loader from data" in err, err
    log = (run / "trainer.log").read_text()
    assert log.count("ImportError: cannot import name shard_loader") <= 2


def test_the_bootstrap_records_a_workers_own_exit_and_not_a_kill(tmp_path):
    """A worker (torchrun's variables set) that exits by itself leaves its line; one killed
    by a signal leaves none; a process that is not a worker is left alone."""
    from rankguard.client.bootstrap import FOLDER

    guard = tmp_path / "exits.jsonl"
    worker = {"RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "j",
              "TORCHELASTIC_RESTART_COUNT": "0", "RANKGUARD_COLLECTIVE_WATCH": "0"}  # fmt: skip
    base = {**os.environ, "PYTHONPATH": FOLDER, sg.ENV: str(guard)}

    def run(code: str, env: dict) -> int:
        return subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode

    assert run("raise SystemExit(2)", {**base, **worker}) == 2
    (line,) = sg.read(guard)
    assert (line.rank, line.restart, line.had_group) == (1, 0, False) and line.lived < 30
    assert run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", {**base, **worker}) < 0
    assert run("raise SystemExit(1)", base) == 1  # not a torchrun worker
    assert len(sg.read(guard)) == 1
    # an uncaught exception: its own traceback is in its line (the log interleaves ranks)
    assert run("raise ValueError('bad shard')", {**base, **worker}) == 1
    last = sg.read(guard)[-1]
    assert last.error.startswith("Traceback") and last.error.endswith("ValueError: bad shard")
