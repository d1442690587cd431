"""`rankguard up` turns the workers' flight recorders on (what the Reporter reads while a
rank stalls, client/flight_recorder.py) and points NCCL's dump on a collective timeout
into the run's folder, leaving alone what the user set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, os, sys
names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
         "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
with open(sys.argv[1], "w") as f:
    json.dump({n: os.environ.get(n) for n in names}, f)
"""


def worker_env(tmp_path: Path, **env: str) -> dict:
    script, seen, run = tmp_path / "env.py", tmp_path / "seen.json", tmp_path / "run"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR", "TORCH_NCCL"))}
    proc = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--nproc", "1", "--run-dir", str(run),
         "--", str(script), str(seen)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**base, "XDG_CONFIG_HOME": str(tmp_path / "config"), **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(seen.read_text())


@pytest.mark.slow
def test_up_turns_the_workers_flight_recorders_on(tmp_path):
    seen = worker_env(tmp_path)
    folder = (tmp_path / "run" / "flight-recorder").absolute()
    assert seen == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": None,  # torch 2.13 reads the first; this one warns
        "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/rank_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None,
    }
    assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700


@pytest.mark.slow
def test_up_keeps_the_users_own_choice(tmp_path):
    seen = worker_env(tmp_path, TORCH_NCCL_TRACE_BUFFER_SIZE="0",
                      TORCH_FR_DUMP_TEMP_FILE="/var/tmp/mine_")  # fmt: skip
    assert seen["TORCH_FR_BUFFER_SIZE"] == "0"  # off, as the user said (in the old name)
    assert seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    assert seen["TORCH_FR_DUMP_TEMP_FILE"] == "/var/tmp/mine_"
