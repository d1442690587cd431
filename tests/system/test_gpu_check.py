"""scripts/gpu-check on a machine without an NVIDIA GPU: one line, exit 0, nothing claimed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_and_claims_nothing():
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is here: scripts/gpu-check would run the GPU checks")
    report = ROOT / "bench" / "results" / "gpu.md"
    before = report.read_bytes() if report.exists() else None
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "gpu-check: no NVIDIA GPU here (nvidia-smi finds none); nothing checked"
    ]
    assert (report.read_bytes() if report.exists() else None) == before


def test_help_lists_every_part():
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check"), "--help"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0
    for part in ("env", "tests", "peak", "throughput", "comm", "checkpoint", "agent", "recovery"):
        assert part in proc.stdout
