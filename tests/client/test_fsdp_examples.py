"""examples/fsdp_plain.py (no rankguard) and examples/fsdp_client.py (rankguard.client:
Reporter with FSDP2 comm timing, CheckpointStore) under `rankguard up --nproc 2`, FSDP2
`fully_shard` with gloo on the CPU. In one run a worker is SIGKILLed, and after the
restart a worker is SIGSTOPped: each is an incident naming the rank, torchrun restarts the
group, the script resumes from its checkpoint and the run exits 0. With the library the
incidents also carry steps."""

from __future__ import annotations

import difflib
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from up_run import Up, left_running, log_has, read_incidents

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "fsdp_plain.py"
CLIENT = ROOT / "examples" / "fsdp_client.py"


def test_fsdp_example_differs_from_the_plain_script_by_at_most_ten_lines():
    plain, client = PLAIN.read_text().splitlines(), CLIENT.read_text().splitlines()
    changed = [
        line
        for line in difflib.unified_diff(plain, client, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert 0 < len(changed) <= 10, changed
    assert any("attach" in line or "Reporter(model)" in line for line in changed)
    assert any("CheckpointStore(" in line for line in changed)


def _rank(agent_url: str, job: str, rank: int, other_than: int | None, timeout: float) -> dict:
    """Rank `rank` of `job` alive in the agent (with a pid other than `other_than`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(agent_url + "/v1/ranks", timeout=5) as resp:
            for r in json.loads(resp.read())["ranks"]:
                if (r["job"], r["rank"], r["state"]) == (job, rank, "alive") and r[
                    "pid"
                ] != other_than:
                    return r
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} of {job} not seen alive with a new pid")


@pytest.mark.slow
@pytest.mark.parametrize("example", [PLAIN, CLIENT], ids=["plain", "client"])
def test_fsdp_example_survives_a_killed_and_a_stopped_worker(tmp_path, example):
    ckpt = tmp_path / "ckpt"
    up = Up(tmp_path, "--", str(example), "--steps", "160", "--width", "64", "--save-every",
            "10", "--extra-compute", "0.05", "--ckpt", str(ckpt))  # fmt: skip
    try:
        url, job = up.agent_url(), up.run.name
        log_has(up, r"step 30 loss", timeout=240)
        first = _rank(url, job, 1, None, timeout=30)
        os.kill(first["pid"], signal.SIGKILL)
        log_has(up, r"resumed from step [1-9]\d", timeout=120)
        second = _rank(url, job, 1, first["pid"], timeout=60)
        time.sleep(2)  # a few steps of the new incarnation
        os.kill(second["pid"], signal.SIGSTOP)
        code = up.wait(timeout=300)
    finally:
        up.close()
    assert code == 0, up.output()[-4000:]
    log = (up.run / "trainer.log").read_text()
    assert log.count("resumed from step") >= 2 and "step 160 loss" in log, log[-3000:]
    incidents = [i for i in read_incidents(up.run) if i["job"] == up.run.name]
    dead = [i for i in incidents if i["kind"] == "rank_dead"]
    hung = [i for i in incidents if i["kind"] == "rank_hung"]
    assert [i["rank"] for i in hung] == [1], incidents
    # the SIGKILL, then (after the hang) possibly the supervisor's own kill of the culprit
    assert dead and {i["rank"] for i in dead} == {1} and dead[0]["id"] < hung[0]["id"], incidents
    assert hung[0]["action"] == "kill_rank", hung[0]
    assert "stopped" in json.loads(hung[0]["evidence"])["culprit_reason"], hung[0]
    if example == CLIENT:  # telemetry: the step at detection and the step resumed from
        for i in (dead[0], hung[0]):
            assert i["step_at_detect"] is not None and i["resumed_step"] is not None, i
            assert i["resumed_step"] % 10 == 0 and i["resumed_step"] <= i["step_at_detect"], i
        assert any(p.name.startswith("step-") for p in ckpt.iterdir())
    else:  # zero-code: the step its AdamW keeps, read by rankguard's hook, as last sent
        assert 0 < dead[0]["step_at_detect"] <= 160, dead[0]
        assert "(its optimizer's count)" in dead[0]["summary"], dead[0]
        assert (ckpt).is_file()
    assert left_running(up.run) == []
