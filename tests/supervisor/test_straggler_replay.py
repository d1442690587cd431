"""bench/straggler_replay.py replay on a synthetic recording: the tool that tuned the
straggler detector keeps working with it (the detector's own rules are tested in
test_detectors.py; `record` runs what test_supervisor_faults.py runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "straggler_replay.py"


def _recording(path: Path, slow_from: int | None) -> Path:
    """Two ranks, 120 steps of 0.15 s polled every 0.5 s; rank 1 1.3x slower from
    `slow_from` on, rank 0 waiting for it in communication."""
    samples = []
    for step in range(1, 121):
        slow = slow_from is not None and step >= slow_from
        for rank in (0, 1):
            compute = 0.1 * (1.3 if slow and rank == 1 else 1.0)
            comm = 0.01 + (0.03 if slow and rank == 0 else 0.0)
            samples.append({"rank": rank, "step": step, "phase": "train", "restart": 0,
                            "pid": 100 + rank, "step_seconds": 0.15, "compute_seconds": compute,
                            "comm_seconds": comm, "data_wait_seconds": 0.001, "loss": 3.0,
                            "compute_wait_seconds": 0.0,
                            "seen": 1000.0 + 0.5 * ((step * 0.15) // 0.5 + 1)})  # fmt: skip
    path.write_text(json.dumps({"samples": samples, "incidents": []}))
    return path


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), "replay", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_replay_names_the_slowed_rank_and_not_a_clean_one(tmp_path):
    slowed = _recording(tmp_path / "slowed.json", slow_from=60)
    clean = _recording(tmp_path / "clean.json", slow_from=None)
    out = _replay(str(slowed), str(clean), "--set", "excess_limit=1000")
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[3:5] for line in out.stdout.splitlines()
            if line.startswith("| ") and ".json" in line}  # fmt: skip
    default, median_only = rows["slowed.json"]
    # (step, rank) of the first finding: rank 1, after the slowdown, in time
    first = [int(x) for x in default.split(")")[0].strip(" (").split(",")]
    assert first[1] == 1 and 60 < first[0] <= 90, default
    assert "(" in median_only and "[1]" in median_only, median_only
    assert [c.split(",")[0].strip() for c in rows["clean.json"]] == ["none", "none"], rows


def test_a_bad_setting_is_refused_with_the_keys(tmp_path):
    clean = _recording(tmp_path / "clean.json", slow_from=None)
    out = _replay(str(clean), "--set", "no_such=1")
    assert out.returncode != 0 and "excess_limit" in out.stderr
