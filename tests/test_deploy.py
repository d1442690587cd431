"""Deployment files: the systemd unit verifies; README and CI agree on the test command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, flags=re.S)
    test_cmd = next(b for b in blocks if "test" in b)
    ci_lines = [
        line for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]  # fmt: skip
    assert ci_lines == [test_cmd]


@pytest.mark.parametrize(
    "unit", sorted(p.name for p in (ROOT / "deploy/systemd").glob("*.service"))
)
def test_systemd_unit_verifies(tmp_path, unit):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    text = (ROOT / "deploy/systemd" / unit).read_text()
    # Point ExecStart at this checkout's console script so verify can check it exists.
    exe = Path(sys.executable).with_name("rankguard")
    local = tmp_path / unit
    local.write_text(text.replace("/opt/rankguard/.venv/bin/rankguard", str(exe)))
    proc = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # no warnings either
    sec = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(local)],
        capture_output=True,
        text=True,
    )
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec.stdout).group(1))
    assert score <= 3.0, sec.stdout[-2000:]
