"""The trainer's `--wait-mode spin` (trainer/spin_wait.py) and the `native-stall` fault:
CPU stand-ins for how a rank waits, or is stuck, on NCCL. Spinning changes how a rank
waits, never what it computes; and the signature is the one NCCL shows: a waiting rank's
main thread busy, where on gloo it sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from harness import read_json, run_ok, trainer_command

from rankguard.cli.local_stack import TelemetrySink
from rankguard.trainer.config import ConfigError, config_from_args
from rankguard.trainer.faults import parse_fault_spec


def test_wait_mode_from_flag_or_environment_and_refused_with_fsdp():
    assert config_from_args([], {}).wait_mode == "block"
    assert config_from_args(["--wait-mode", "spin"], {}).wait_mode == "spin"
    assert config_from_args([], {"RANKGUARD_WAIT_MODE": "spin"}).wait_mode == "spin"
    assert config_from_args(["--wait-mode", "block"], {"RANKGUARD_WAIT_MODE": "spin"}).wait_mode == "block"  # fmt: skip
    with pytest.raises(ConfigError, match="block or spin"):
        config_from_args([], {"RANKGUARD_WAIT_MODE": "busy"})
    with pytest.raises(ConfigError, match="not with --fsdp"):
        config_from_args(["--wait-mode", "spin", "--fsdp"], {})


def test_native_stall_spec():
    assert parse_fault_spec("native-stall:step=9:rank=1").seconds == 0.0  # 0: forever
    s = parse_fault_spec("native-stall:step=9:seconds=2:restart=3")
    assert (s.kind, s.step, s.seconds, s.restart) == ("native-stall", 9, 2.0, 3)


def test_a_timed_native_stall_spins_then_returns():
    from rankguard.trainer.faults import FaultInjector

    inj = FaultInjector((parse_fault_spec("native-stall:step=2:seconds=0.3"),), 0, 0)
    inj.at_step_start(1)  # not its step
    before, start = on_cpu_or_runnable_seconds(), time.monotonic()
    inj.at_step_start(2)
    wall, busy = time.monotonic() - start, on_cpu_or_runnable_seconds() - before
    # busy, not asleep: running, or waiting only for a core (this machine is shared)
    assert 0.3 <= wall < 2.0 and busy > 0.8 * wall, (wall, busy)


def on_cpu_or_runnable_seconds() -> float:
    """This thread's time on a CPU plus its time waiting in the run queue (schedstat): a
    spinning thread's sum keeps up with the wall clock however busy the machine is, a
    sleeping one's does not."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        on_cpu_ns, runnable_ns, _ = map(int, f.read().split())
    return (on_cpu_ns + runnable_ns) / 1e9


@pytest.mark.slow
def test_spin_mode_trains_to_the_same_digest_as_block_mode(tmp_path):
    """Three ranks, not two: averaging by x * (1/3), DDP's arithmetic, is not always x / 3
    (torch's allreduce_hook), which two ranks cannot tell apart."""
    args = ["--steps", "6", "--global-batch", "24"]
    run_ok([*args, "--summary", str(tmp_path / "block.json")], nproc=3, cwd=tmp_path)
    run_ok([*args, "--summary", str(tmp_path / "spin.json")], nproc=3, cwd=tmp_path,
           env={"RANKGUARD_WAIT_MODE": "spin"})  # fmt: skip
    block, spin = read_json(tmp_path / "block.json"), read_json(tmp_path / "spin.json")
    assert spin["final_step"] == block["final_step"] == 6
    assert spin["param_digest"] == block["param_digest"]


def main_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process's main thread (its tid is its pid)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


BUSY, IDLE = 0.3, 0.1  # CPU seconds of a main thread over 1 s: busy above, idle below


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,fault,busy",
    [
        ("block", "hang", {0: False, 1: False}),  # gloo: the waiting rank sleeps
        ("spin", "hang", {0: True, 1: False}),  # NCCL: the waiting rank spins
        ("block", "native-stall", {0: False, 1: True}),  # the stuck rank spins in C
    ],
)
def test_main_thread_cpu_while_rank_1_is_stuck(tmp_path, mode, fault, busy):
    sock = tmp_path / "t.sock"
    cmd, env = trainer_command(
        ["--steps", "40", "--wait-mode", mode, "--fault", f"{fault}:step=4:rank=1"],
        env={"RANKGUARD_TELEMETRY_SOCKET": str(sock)},
    )
    pids: dict[int, int] = {}
    with TelemetrySink(sock) as sink:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 90
            while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
                pids = {r.rank: r.pid for r in list(sink.records) if r.step == 3}
                time.sleep(0.05)
            assert len(pids) == 2, "both ranks should have reported step 3"
            time.sleep(0.5)  # rank 0 is into step 4's all-reduce, rank 1 stuck before it
            before = {r: main_thread_cpu_seconds(p) for r, p in pids.items()}
            time.sleep(1.0)
            used = {r: main_thread_cpu_seconds(p) - before[r] for r, p in pids.items()}
            assert max(r.step for r in sink.train_records(0)) == 3, "no step past the fault"
            for rank, expect in busy.items():
                if expect:
                    assert used[rank] > BUSY, (rank, used)
                else:
                    assert used[rank] < IDLE, (rank, used)
        finally:
            for pid in pids.values():  # the ranks run in sessions of their own (torchrun's)
                with _gone():
                    os.kill(pid, signal.SIGKILL)
            with _gone():
                os.killpg(proc.pid, signal.SIGTERM)  # torchrun ends any rank not known yet
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _gone():
    import contextlib

    return contextlib.suppress(ProcessLookupError)
