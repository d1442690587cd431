"""Warm start (trainer/warm.py): workers forked from a server that imported torch once,
under real torchrun. Same training as a cold start, same failure semantics for torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from harness import free_port, read_json, torchrun, wait_until

from rankguard.trainer.warm import start_server

pytestmark = pytest.mark.slow

WARM = ("rankguard.trainer.warm", "run")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module: it keeps serving across requests, and its start (the
    torch import) is paid once."""
    path = tmp_path_factory.mktemp("warm") / "warm.sock"
    proc = start_server(path, {**os.environ, "OMP_NUM_THREADS": "1"}, subprocess.DEVNULL)
    yield path, proc
    proc.terminate()
    proc.wait(timeout=10)


def trace_pids(path) -> dict[int, set[int]]:
    """pids of the workers of each incarnation, from the startup trace."""
    out: dict[int, set[int]] = {}
    for line in path.read_text().splitlines():
        m = json.loads(line)
        out.setdefault(m["restart"], set()).add(m["pid"])
    return out


def test_warm_workers_train_exactly_like_cold_ones_and_survive_a_crash(server, tmp_path, clean_40):
    """A crash at step 27 (the worker SIGKILLs itself): the shim dies the same way (or its
    peer fails first on the broken all-reduce), torchrun restarts the group, new workers are forked warm, and the run ends with the
    uninterrupted run's digest."""
    path, proc = server
    trace = tmp_path / "trace.jsonl"
    run = torchrun(
        ["--steps", "40", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
         "--summary", str(tmp_path / "s.json"), "--fault", "crash:step=27:rank=1"],
        cwd=tmp_path, max_restarts=1, entry=WARM,
        env={"RANKGUARD_WARM_SOCKET": str(path), "RANKGUARD_STARTUP_TRACE": str(trace)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert read_json(tmp_path / "s.json")["param_digest"] == clean_40["param_digest"]
    pids = trace_pids(trace)
    assert sorted(pids) == [0, 1] and all(len(p) == 2 for p in pids.values())
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)],
                              capture_output=True, text=True).stdout.split()  # fmt: skip
    assert children == [], "workers left behind"
    assert not any(os.path.exists(f"/proc/{p}") for s in pids.values() for p in s)


def shim(path, tmp_path, trace, *args: str) -> subprocess.Popen:
    """One shim as torchrun would start it, for a world of one."""
    return subprocess.Popen(
        [sys.executable, "-m", "rankguard.trainer.warm", "run", "--preset", "tiny",
         "--log-every", "0", *args],
        env={**os.environ, "RANKGUARD_WARM_SOCKET": str(path), "RANKGUARD_STARTUP_TRACE": str(trace),
             "RANKGUARD_TELEMETRY_SOCKET": "off", "WORLD_SIZE": "1", "RANK": "0",
             "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
        cwd=tmp_path, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def test_the_shim_ends_as_its_worker_did(server, tmp_path):
    path, _ = server
    ok = shim(path, tmp_path, tmp_path / "a.jsonl", "--steps", "3")
    crash = shim(path, tmp_path, tmp_path / "b.jsonl", "--steps", "9", "--fault", "crash:step=2")
    assert (ok.wait(timeout=120), crash.wait(timeout=120)) == (0, -9)
    bad = shim(path, tmp_path, tmp_path / "c.jsonl", "--steps", "-1")  # refused by the trainer
    assert bad.wait(timeout=120) == 2


def test_a_worker_dies_with_its_shim(server, tmp_path):
    """torchrun SIGKILLs the shim on teardown: the forked worker must not outlive it."""
    path, _ = server
    trace = tmp_path / "trace.jsonl"
    proc = shim(path, tmp_path, trace, "--steps", "100000")
    wait_until(lambda: trace.exists() and "first_step" in trace.read_text(), 60, "a first step")
    [worker] = trace_pids(trace)[0]
    assert worker != proc.pid
    proc.kill()
    proc.wait()
    wait_until(lambda: not os.path.exists(f"/proc/{worker}"), 10, "the worker to die")


def test_bad_requests_are_refused_and_the_server_keeps_serving(server):
    path, proc = server
    for payload in (b"", b"\x00\x00\x00\x05{bad", b"garbage without descriptors"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100) == b""  # closed without forking anything
    time.sleep(0.2)
    assert proc.poll() is None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))  # still accepting


SCRIPT = """
import json, os, sys, torch
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "pid": os.getpid(), "torch": "torch" in sys.modules}), flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the script failed")
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(sys.argv[1]))
"""


def test_a_script_runs_forked_as_python_would_run_it(server, tmp_path):
    """`run --script PATH ARGS`: the forked worker runs the script as __main__ with its argv
    and directory; the shim exits as it did (status, uncaught exception, fatal signal)."""
    path, proc = server
    (tmp_path / "t.py").write_text(SCRIPT)

    def shim_script(arg: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rankguard.trainer.warm", "run", "--script", "t.py", arg],
            env={**os.environ, "RANKGUARD_WARM_SOCKET": str(path)}, cwd=tmp_path,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    ok = shim_script("0")
    assert ok.returncode == 0, ok.stderr
    seen = json.loads(ok.stdout)
    assert (seen["name"], seen["argv"], seen["path0"]) == ("__main__", ["t.py", "0"], str(tmp_path))
    assert seen["pid"] != proc.pid and seen["torch"]
    assert "starting cold" not in ok.stderr  # forked by the server
    assert shim_script("3").returncode == 3
    failed = shim_script("raise")
    assert failed.returncode == 1 and "RuntimeError: the script failed" in failed.stderr
    assert shim_script("kill").returncode == -9
