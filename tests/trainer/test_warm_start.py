"""Warm start cannot poison a worker (trainer/warm.py, trainer/warm_checks.py): a fork of a
server with CUDA initialised, or whose torch read another environment at import, is refused
and the shim starts cold, saying why in one line; a forked worker runs on the shim's CPUs.
The real server and the real shim, running a script that reports where it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rankguard.trainer import warm_checks
from rankguard.trainer.warm import ENV, PRELOAD_ENV, start_server

# The server's and the shims' environment, without the variables the tests set themselves.
BASE = {k: v for k, v in os.environ.items() if not k.startswith(warm_checks.PREFIXES)}

# torch is in sys.modules before the script imports it only in a forked (warm) worker.
TARGET = """
import json, os, sys
torch = sys.modules.get("torch")
print(json.dumps({"ppid": os.getppid(), "cpus": sorted(os.sched_getaffinity(0)),
                  "threads": torch.get_num_threads() if torch else None}))
"""

# A CUDA init on a CPU build: the flag torch.cuda's lazy init sets, which
# torch.cuda.is_initialized() (warm_checks.cuda_initialised) reads.
CUDA_STAND_IN = "import torch.cuda\ntorch.cuda._initialized = True\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm") / "warm.sock"
    proc = start_server(path, BASE, subprocess.DEVNULL)
    yield path, proc
    proc.terminate()
    proc.wait(timeout=10)


def shim(path, cwd, cpus: set[int] | None = None, **env: str) -> tuple[dict, str]:
    """Run TARGET through the shim (on `cpus` when given): what it printed, the stderr."""
    (cwd / "t.py").write_text(TARGET)
    done = subprocess.run(
        [sys.executable, "-m", "rankguard.trainer.warm", "run", "--script", "t.py"],
        env={**BASE, ENV: str(path), **env}, cwd=cwd, capture_output=True, text=True,
        timeout=60, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def started_cold(seen: dict, err: str, why: str) -> bool:
    """The script ran in the shim itself (our child), after exactly one line naming why."""
    return seen["ppid"] == os.getpid() and err.count("\n") == 1 and why in err


def test_a_preload_that_initialises_cuda_makes_every_later_worker_start_cold(tmp_path):
    (tmp_path / "cuda_stand_in.py").write_text(CUDA_STAND_IN)
    path, on_path = tmp_path / "warm.sock", {"PYTHONPATH": str(tmp_path)}  # the server's too
    proc = start_server(path, {**BASE, **on_path}, subprocess.DEVNULL)
    try:
        seen, err = shim(path, tmp_path, **on_path)
        assert seen["ppid"] == proc.pid, err  # forked while CUDA is untouched
        seen, err = shim(path, tmp_path, **on_path, **{PRELOAD_ENV: "cuda_stand_in"})
        assert started_cold(seen, err, "CUDA was initialised"), err
        assert "cuda_stand_in" in err and "starting cold" in err
        seen, err = shim(path, tmp_path, **on_path)  # CUDA stays initialised in the server
        assert started_cold(seen, err, "CUDA was initialised"), err
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("name", ["TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCH_LOGS"])
def test_an_import_time_variable_unlike_the_servers_makes_the_worker_start_cold(
    server, tmp_path, name
):
    path, proc = server
    seen, err = shim(path, tmp_path)
    assert seen["ppid"] == proc.pid and err == ""  # the same job without it is forked
    seen, err = shim(path, tmp_path, **{name: "0"})
    assert started_cold(seen, err, f"the job's {name} differs from the warm server's"), err


def test_the_worker_runs_on_the_shims_cpus_with_threads_to_match(server, tmp_path):
    path, proc = server
    cpus = sorted(os.sched_getaffinity(proc.pid))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs, to give the shim fewer than the server")
    seen, err = shim(path, tmp_path, cpus={cpus[-1]})
    assert seen["ppid"] == proc.pid, err  # forked: a cold start would have the CPUs anyway
    assert (seen["cpus"], err) == ([cpus[-1]], "")
    assert seen["threads"] == 1  # not the server's default: no more threads than CPUs
    wide, _ = shim(path, tmp_path)
    asked = str(wide["threads"] + 1)  # a whole OMP_NUM_THREADS is applied, not a reason
    seen, err = shim(path, tmp_path, OMP_NUM_THREADS=asked)
    assert (seen["ppid"], seen["threads"], err) == (proc.pid, int(asked), "")


# -- the pure parts (warm_checks) ----------------------------------------------------------


def test_import_time_differences_are_named_whichever_side_sets_them():
    server = {"TORCH_LOGS": "+dynamo", "OMP_NUM_THREADS": "1", "HOME": "/a", "PYTHONPATH": "/p"}
    job = {
        "HOME": "/b",  # read when used: the worker's own
        "PYTHONPATH": "/p",  # the same value: nothing to honour
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",  # set in the job only
        "OMP_NUM_THREADS": "4",  # applied by the worker
        "OMP_PROC_BIND": "close",  # libgomp's, read at load
    }
    # TORCH_LOGS is the server's only: the worker would log what the job never asked
    assert warm_checks.unhonoured(server, job) == [
        "OMP_PROC_BIND", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCH_LOGS",
    ]  # fmt: skip
    assert warm_checks.unhonoured(server, {**job, "OMP_NUM_THREADS": "4,2"})[0] == "OMP_NUM_THREADS"
    unset = {k: v for k, v in job.items() if k != "OMP_NUM_THREADS"}  # applied too
    assert "OMP_NUM_THREADS" not in warm_checks.unhonoured(server, unset)
    line = warm_checks.env_reason(["TORCHINDUCTOR_MAX_AUTOTUNE", "TORCH_LOGS"])
    assert "TORCHINDUCTOR_MAX_AUTOTUNE, TORCH_LOGS" in line and "torch._inductor.config" in line
    assert "\n" not in line


def test_worker_threads_follow_the_job_not_the_server():
    assert warm_checks.worker_threads("3", None, 2, 2) == 3  # the job's whole number
    assert warm_checks.worker_threads("2", "2", 2, 2) is None  # already so
    assert warm_checks.worker_threads(None, None, 8, 2) == 2  # capped at the job's CPUs
    assert warm_checks.worker_threads(None, None, 2, 8) is None  # the server's default
    assert (
        warm_checks.worker_threads(None, "1", 1, 8) == 8
    )  # the server's own setting: not the job's
    assert warm_checks.worker_threads("4,2", "4,2", 4, 8) is None  # torch read the same


def test_the_shims_cgroup_is_found_on_cgroup_v2_only():
    v2 = "0::/system.slice/job-7.scope\n"
    assert warm_checks.cgroup_procs(v2) == "/sys/fs/cgroup/system.slice/job-7.scope/cgroup.procs"
    assert warm_checks.cgroup_procs("0::/\n") == "/sys/fs/cgroup/cgroup.procs"
    assert warm_checks.cgroup_procs("9:cpuset:/slurm/job_7\n1:name=systemd:/\n") is None
