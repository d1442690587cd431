"""The trainer on a real GPU: bf16 autocast, pinned-memory async checkpoints, MFU, and
exact resume with --deterministic (a SIGKILLed run resumes to the uninterrupted digest)."""

from __future__ import annotations

import pytest
from harness import read_json, run_ok

from rankguard.trainer.mfu import datasheet_peak

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ARGS = ["--steps", "30", "--ckpt-every", "10"]


def test_killed_run_resumes_to_the_uninterrupted_digest_with_deterministic_kernels(tmp_path):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    for d in (clean, killed):
        d.mkdir()
    run_ok([*ARGS, "--ckpt-dir", str(clean / "ckpt"), "--summary", str(clean / "s.json")],
           cwd=clean, nproc=1)  # fmt: skip
    proc = run_ok(
        [*ARGS, "--ckpt-dir", str(killed / "ckpt"), "--summary", str(killed / "s.json"),
         "--fault", "crash:step=25:rank=0"],
        cwd=killed, nproc=1, max_restarts=1,
    )  # fmt: skip
    a, b = read_json(clean / "s.json"), read_json(killed / "s.json")
    assert "exitcode: -9" in proc.stderr  # the rank really died by SIGKILL
    # Step 20's save may still be in flight at the crash (GPU steps are fast): then the
    # newest validated checkpoint is step 10's, and resuming from it must match all the same.
    assert b["resumed_from"] in (10, 20) and b["final_step"] == 30
    assert a["deterministic"] and a["digest_reproducible"]
    assert a["checkpoint_saves"] == 3 and a["newest_validated_checkpoint"] == 30
    assert b["param_digest"] == a["param_digest"]
    assert b["final_loss"] == a["final_loss"]


def test_without_deterministic_the_summary_says_the_digest_may_differ(tmp_path):
    run_ok(["--steps", "10", "--summary", str(tmp_path / "s.json")], cwd=tmp_path, nproc=1,
           deterministic=False)  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert s["deterministic"] is False and s["digest_reproducible"] is False
    assert "not expected to match" in s["digest_note"]
    assert s["device"] != "cpu"
    # MFU against the datasheet peak of a known GPU, or the measured matmul of another.
    known = datasheet_peak(s["device"])
    assert s["peak_flops"] == known if known else s["peak_flops"] > 1e12
    assert 0 < s["mfu"] < 1, s


def test_two_ranks_sharing_one_gpu_train_through_gloo(tmp_path):
    """NCCL refuses two ranks on one GPU: with more local ranks than GPUs the trainer
    all-reduces through gloo, checkpoints and resumes as usual."""
    proc = run_ok(
        [*ARGS, "--ckpt-dir", str(tmp_path / "ckpt"), "--summary", str(tmp_path / "s.json"),
         "--fault", "crash:step=15:rank=1"],
        cwd=tmp_path, nproc=2, max_restarts=1,
    )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    if "share" not in proc.stderr:
        pytest.skip("more than one GPU: each rank has its own")
    assert s["resumed_from"] == 10 and s["final_step"] == 30 and s["world_size"] == 2


def test_the_ranks_gpu_uuid_is_nvmls_and_a_gpu_per_process_is_nccl():
    """The UUID a rank computes on is one NVML lists (the agent ties faults by it), and a
    rank that sees only its own GPU (per-process CUDA_VISIBLE_DEVICES) gets NCCL."""
    import pynvml
    import torch

    from rankguard.client.gpu_identity import device_uuid
    from rankguard.trainer.distributed import NCCL_BACKEND, backend_for

    pynvml.nvmlInit()
    try:
        nvml = {
            str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
            for i in range(pynvml.nvmlDeviceGetCount())
        }
    finally:
        pynvml.nvmlShutdown()
    uuid = device_uuid(torch.device("cuda", 0))
    assert uuid in nvml, (uuid, nvml)
    assert backend_for([uuid]) == (NCCL_BACKEND, None)
