"""Run the real trainer under real torchrun (shared by the test modules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def torchrun(
    args: list[str],
    *,
    cwd: Path,
    nproc: int = 2,
    max_restarts: int = 0,
    env: dict | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone` of the bundled trainer; output captured for assertions."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": "off"}
    full_env.update(env or {})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "-m", "rankguard.trainer", "--preset", "tiny", "--log-every", "0", *args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    return proc


def run_ok(args: list[str], **kw) -> subprocess.CompletedProcess:
    proc = torchrun(args, **kw)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
