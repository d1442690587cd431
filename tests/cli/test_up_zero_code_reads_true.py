"""A zero-code job (`rankguard up -- examples/ddp_plain.py`) reads as it is: healthy while
healthy (no checkpoint directory rankguard invented and then found missing), goodput
unknown rather than 0.0%, "restarted" rather than "resuming" from a checkpoint nobody
saw, and the example resumes from its own checkpoint after a kill, which its incident
names with the step it happened at."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from harness import http_json
from up_run import Up, left_running, read_incidents

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "ddp_plain.py")
RANKGUARD = [sys.executable, "-m", "rankguard.cli.main"]


def _exports(env_file: Path) -> dict[str, str]:
    (line,) = env_file.read_text().splitlines()
    assert line.startswith("export ")
    return dict(pair.split("=", 1) for pair in shlex.split(line[len("export ") :]))


def test_health_shows_a_job_without_steps_as_unknown_not_zero():
    from rankguard.cli.supervisor import job_line

    plain = {"state": "running", "max_step": 0, "ranks": 2, "restart": 0, "goodput": 0.0}
    assert job_line("j", plain) == (
        "job j: running, step -, 2 ranks, restart 0, goodput unknown (no steps reported)"
    )
    trained = {**plain, "max_step": 40, "goodput": 0.5}
    assert job_line("j", trained) == "job j: running, step 40, 2 ranks, restart 0, goodput 50.0%"


@pytest.mark.slow
def test_a_clean_zero_code_run_reads_healthy_from_start_to_end(tmp_path):
    """Run from its own directory with the default run directory (relative, as a user
    types it); `rankguard health` is asked from another directory through the export
    file, and exits 0 every time."""
    with tempfile.TemporaryDirectory(prefix="rg-") as short:  # room for the socket paths
        _clean_run(Path(short) / "project", tmp_path)


def _clean_run(here: Path, elsewhere: Path) -> None:
    here.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}
    proc = subprocess.Popen([*RANKGUARD, "up", "--nproc", "2", "--", EXAMPLE, "--steps", "400"],
                            cwd=here, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    codes = []
    try:
        deadline = time.monotonic() + 120
        while not list(here.glob("runs/up-*/env.sh")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        (env_file,) = here.glob("runs/up-*/env.sh")
        exports = _exports(env_file)
        while proc.poll() is None:
            health = subprocess.run([*RANKGUARD, "health"], cwd=elsewhere, capture_output=True,
                                    text=True, env={**env, **exports}, timeout=60)  # fmt: skip
            # answered while the job ran: up ends its daemons once training completed
            if proc.poll() is None and "training completed" not in "".join(out):
                codes.append((health.returncode, health.stdout + health.stderr))
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    reader.join(timeout=10)
    stdout, stderr = "".join(out), proc.stderr.read()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert codes and all(code == 0 for code, _ in codes), [c for c in codes if c[0]]
    assert all("goodput unknown" in text for _, text in codes if "job " in text), codes
    assert "[degraded]" not in stdout and "[unhealthy]" not in stdout, stdout
    assert "goodput unknown" in stdout and "goodput 0.0%" not in stdout, stdout
    run = env_file.parent
    # no checkpoint directory named or made for a script that keeps its own
    assert "RANKGUARD_CKPT_DIR" not in exports and not (run / "ckpt").exists()
    # the export line on screen is the file's, with absolute paths
    assert f"in another shell: {env_file.read_text().strip()}" in stdout
    for name in ("RANKGUARD_TOKEN_FILE", "RANKGUARD_FAULT_FILE"):
        assert Path(exports[name]).is_absolute() and Path(exports[name]).exists(), exports
    assert left_running(run) == []


@pytest.mark.slow
def test_the_example_resumes_from_its_own_checkpoint_after_a_kill(tmp_path):
    """...and its incident names the step (the script's AdamW keeps one)."""
    ckpt = tmp_path / "ddp_plain.pt"
    up = Up(tmp_path, "--", EXAMPLE, "--steps", "500", "--save-every", "20", "--ckpt", str(ckpt))
    try:
        agent = up.agent_url()
        deadline = time.monotonic() + 180
        # its first checkpoint (step 20), and rank 1's step as the agent has it from the
        # watch's beacon (the step an incident can name: none before the first one)
        while not (ckpt.exists() and (_script_step(agent, 1) or 0) > 1):
            assert up.proc.poll() is None and time.monotonic() < deadline, up.output()
            time.sleep(0.1)
        exports = _exports(up.run / "env.sh")
        inject = subprocess.run([*RANKGUARD, "inject", "kill", "--rank", "1"], capture_output=True,
                                text=True, env={**os.environ, **exports}, timeout=60)  # fmt: skip
        assert inject.returncode == 0, inject.stdout + inject.stderr
        code = up.wait(timeout=400)
    finally:
        up.close()
    output = up.output()
    assert code == 0, output[-4000:]
    log = (up.run / "trainer.log").read_text()
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", log)]
    assert resumed and resumed[0] >= 20, log[-3000:]
    incidents = read_incidents(up.run)
    assert [i["kind"] for i in incidents if i["rank"] == 1][:1] == ["rank_dead"], incidents
    # the incident names the step it died at: AdamW's own count, read by rankguard's hook
    # and last sent by the watch (at most half a second before the death)
    (death,) = [i for i in incidents if i["rank"] == 1][:1]
    assert death["step_at_detect"] is not None and death["step_at_detect"] > 1, death
    # its own step in its summary (the job's step at detection is its peers' newest)
    named = re.search(r"step (\d+) \(its optimizer's count\)", death["summary"])
    assert named and int(named.group(1)) > 1, death
    # nobody saw a resume: the live view says restarted, never resuming
    assert "resuming" not in output, output[-3000:]
    assert left_running(up.run) == []


def _script_step(agent: str, rank: int) -> int | None:
    ranks = http_json(agent + "/v1/ranks")["ranks"]
    return next((r.get("script_step") for r in ranks if r["rank"] == rank), None)
