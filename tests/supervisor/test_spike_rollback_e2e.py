"""A loss spike caused by the data, end to end: real torchrun (gloo, 2 ranks), a real agent
and a real supervisor. The `poison` fault makes the batch of data step 45 spike rank 1's
loss in every incarnation, so replaying it would spike again. The trainer validates no
checkpoint after the spike; the supervisor's BAD_NUMERICS policy kills a rank; the
restart rolls back to the newest validated checkpoint before the spike (step 40) and
skips the data steps up to the spike (41..45, the window of 8 less what step 40 already
trained); the spike does not recur and the job completes. The incident's timeline says
what was skipped and from which checkpoint the job resumed, in `rankguard incidents` too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import http_json, read_json, start_agent, start_supervisor, torchrun

pytestmark = pytest.mark.slow

MODEL = ["--d-model", "128", "--n-layer", "4", "--n-head", "4"]  # ~75 ms steps
STEPS, POISONED = 100, 45


def test_data_caused_spike_rolls_back_skips_its_batches_and_completes(tmp_path):
    agent = start_agent(tmp_path)
    supervisor = start_supervisor(tmp_path, [agent.url])
    try:
        proc = torchrun(
            ["--steps", str(STEPS), "--job", "job", *MODEL, "--ckpt-dir", str(tmp_path / "ckpt"),
             "--ckpt-every", "10", "--keep", "0", "--spike-skip-batches", "8",
             "--summary", str(tmp_path / "s.json"), "--fault", f"poison:step={POISONED}:rank=1"],
            cwd=tmp_path, max_restarts=2, env={"RANKGUARD_TELEMETRY_SOCKET": str(agent.socket)},
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        incidents = http_json(supervisor.url + "/v1/incidents")["incidents"]
        shown = subprocess.run(
            [sys.executable, "-m", "rankguard.cli.main", "incidents", "--supervisor", supervisor.url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        supervisor.stop()
        agent.stop()
    s = read_json(tmp_path / "s.json")
    assert s["final_step"] == STEPS and s["resumed_from"] == 40, s
    assert s["data_skips"] == [41, 42, 43, 44, 45], s
    (inc,) = [i for i in incidents if i["kind"] == "bad_numerics"]
    ev = inc["evidence"]
    assert ev["reason"] == "spike" and ev["anomaly_step"] == POISONED and inc["rank"] == 1, inc
    assert ev["checkpoint_step"] == 40 and inc["resumed_step"] == 40, inc
    assert inc["restarted_at"] and inc["state"] == "resolved", inc
    # the incident says which data steps the rollback skipped and where it resumed
    (skipped,) = [e["detail"] for e in inc["events"] if e["what"] == "data skipped"]
    assert skipped["data_steps"] == [[41, 45]] and skipped["count"] == 5, skipped
    assert skipped["resumed_step"] == 40, skipped
    text = "skipped data steps 41..45 (5 steps) after the rollback to the checkpoint of step 40"
    assert shown.returncode == 0 and text in shown.stdout, shown.stdout + shown.stderr
    # the spike was recorded once: the replay never met the poisoned batch again
    records = [
        json.loads(x) for x in (tmp_path / "ckpt/spikes.jsonl").read_text().splitlines() if x
    ]
    assert [(r["data_step"], r["step"], r["rank"]) for r in records] == [(POISONED, POISONED, 1)]
    assert "skipping data steps [41, 42, 43, 44, 45] after the rollback to step 40" in proc.stderr
    assert [i["kind"] for i in incidents] == ["bad_numerics"], incidents
