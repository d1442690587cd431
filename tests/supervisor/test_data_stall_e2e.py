"""A data stall, end to end: real torchrun (gloo, 2 ranks) loading through a real
DataLoader with a worker process, a real agent and a real supervisor. The `data-stall`
fault slows rank 1's loader (in its worker) from step 30 on; the supervisor must name
rank 1 and the phase within the detector's window of 3 steps, and nothing else."""

from __future__ import annotations

import pytest
from harness import http_json, start_agent, start_supervisor, torchrun

pytestmark = pytest.mark.slow

FAULT_STEP, STALL = 30, 0.5  # a 0.5 s stall per step: below the hang detector's 1 s floor
STEPS = 40


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stall")
    agent = start_agent(tmp)
    supervisor = start_supervisor(tmp, [agent.url])
    try:
        proc = torchrun(
            ["--steps", str(STEPS), "--job", "job", "--data-workers", "1",
             "--fault", f"data-stall:step={FAULT_STEP}:rank=1:seconds={STALL}"],
            cwd=tmp, env={"RANKGUARD_TELEMETRY_SOCKET": str(agent.socket)}, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        incidents = http_json(supervisor.url + "/v1/incidents")["incidents"]
        return incidents
    finally:
        supervisor.stop()
        agent.stop()


def test_a_stalled_loader_is_named_with_rank_phase_and_step(stalled):
    (inc,) = [i for i in stalled if i["kind"] == "data_stall"]
    ev = inc["evidence"]
    assert inc["rank"] == 1 and ev["phase"] == "train", inc
    assert inc["cause"] == "data", inc
    assert ev["first_slow_step"] == FAULT_STEP, inc
    # the bound: the detector's window (3 steps: a median of two slow steps of three)
    # plus the agent's and supervisor's polls (a step or two at this speed)
    assert inc["step_at_detect"] <= FAULT_STEP + 5, inc
    assert inc["time_to_detect"] is not None and inc["time_to_detect"] < 5.0, inc
    # the wait was measured in next() on the DataLoader, the worker's sleep included
    assert ev["data_wait_seconds"] >= 0.8 * STALL and ev["data_wait_share"] >= 0.5, ev
    assert ev["peers_data_wait_seconds"] < 0.1 * STALL, ev
    # a slow loader is neither a hang nor a straggler (its compute is unchanged)
    assert [i["kind"] for i in stalled] == ["data_stall"], stalled
