"""Shared helpers: run the real trainer under real torchrun, gate tests on hardware."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from harness import read_json, run_ok


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _can_netns() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"rgprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def pytest_collection_modifyitems(config, items):
    gpu = _has_cuda()
    netns = None
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible here)"))
        if "netns" in item.keywords:
            if netns is None:
                netns = _can_netns()
            if not netns:
                item.add_marker(pytest.mark.skip(reason="needs root and `ip netns`"))


@pytest.fixture
def one_rank():
    """A gloo process group of one rank in this process, for the test's duration."""
    import torch.distributed as dist
    from harness import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def clean_40(tmp_path_factory) -> dict:
    """The reference: an uninterrupted 40-step, 2-rank run with checkpoints every 10."""
    d = tmp_path_factory.mktemp("clean40")
    run_ok(
        ["--steps", "40", "--ckpt-dir", str(d / "ckpt"), "--ckpt-every", "10",
         "--summary", str(d / "summary.json")],
        cwd=d,
    )  # fmt: skip
    return {**read_json(d / "summary.json"), "dir": d}
