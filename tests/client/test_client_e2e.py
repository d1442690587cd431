"""The library's acceptance, end to end: a DDP script with rankguard.client added (Reporter,
CheckpointStore) under `rankguard up --nproc 2 -- script.py` (gloo on the CPU). What
zero-code cannot see, it now sees: incidents carry steps, a rank 1.5x slower than its peer
is named as a straggler, and a NaN loss rolls the job back to a validated checkpoint from
before the NaN (the supervisor kills a rank, torchrun restarts the group, the script
resumes through CheckpointStore) and the job completes. Forged and malformed datagrams on
the library's socket path meanwhile are refused, each counted by its reason."""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.request

import pytest
from up_run import Up, left_running, read_incidents

from rankguard.contract.telemetry import SCHEMA_VERSION

pytestmark = pytest.mark.slow

SCRIPT = """
import argparse, os, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from rankguard.client import CheckpointStore, Reporter

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--ckpt", required=True)
p.add_argument("--ckpt-every", type=int, default=5)
p.add_argument("--compute", type=float, default=0.06)  # pretend compute per step (seconds)
p.add_argument("--slow-rank", type=int, default=-1)  # this rank computes 1.5x as long
p.add_argument("--nan-at", type=int, default=-1)  # rank 1's loss is NaN here (first run)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
first_run = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
ddp = DDP(model)
rg = Reporter(ddp)
store = CheckpointStore(args.ckpt, keep=3, reporter=rg)
start, state = store.resume(weights_only=True)  # rank 0 selects, every rank loads it
if state is not None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    if rank == 0:
        print(f"resumed from step {start}", flush=True)
for step in range(start + 1, args.steps + 1):
    s = rg.step(step, tokens=16)
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(16, 8, generator=g)
    s.phase("compute")
    loss = F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
    if step == args.nan_at and rank == 1 and first_run:
        loss = loss * float("nan")
    time.sleep(args.compute * (1.5 if rank == args.slow_rank else 1.0))
    loss.backward()
    s.phase("optimizer")
    opt.step()
    opt.zero_grad()
    s.loss(loss)
    s.end()
    if rank == 0 and step % args.ckpt_every == 0:
        saved = store.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
        print(f"step {step} checkpoint {'saved' if saved else 'refused'}", flush=True)
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.barrier()
rg.close()
dist.destroy_process_group()
"""


def _ranks_view(agent_url: str) -> dict:
    with urllib.request.urlopen(agent_url + "/v1/ranks", timeout=5) as resp:
        return json.loads(resp.read())


def _wait_for_step(up: Up, agent_url: str, rank: int, step: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in _ranks_view(agent_url)["ranks"]:
            if r["job"] == up.run.name and r["rank"] == rank and (r["step"] or 0) >= step:
                return r
        assert up.proc.poll() is None, up.output()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never reached step {step}")


def _send_hostile_datagrams(up: Up, agent_url: str) -> dict[str, int]:
    """While the job trains: a well-formed record forging rank 1's pid with a NaN loss (it
    would roll the job back), and malformed ones, sent to the socket the library uses.
    Returns the agent's reject counters once all of them are counted."""
    victim = _wait_for_step(up, agent_url, rank=1, step=30, timeout=240)
    before = _ranks_view(agent_url)["telemetry"]["rejected"]
    forged = dict(
        v=SCHEMA_VERSION, job=up.run.name, rank=1, local_rank=1, world_size=2,
        pid=victim["pid"], restart=0, step=victim["step"] + 1, phase="train", time=time.time(),
        step_seconds=0.1, data_wait_seconds=0.0, compute_seconds=0.1, comm_seconds=0.0,
        comm_exposed_seconds=0.0, optimizer_seconds=0.0, checkpoint_block_seconds=0.0,
        tokens_per_second=0.0, mfu=0.0, peak_memory_bytes=0, loss=math.nan,
        checkpoint_step=None,
    )  # fmt: skip
    hostile = {
        "pid_mismatch": json.dumps(forged).encode(),
        "not_json": b"{not json",
        "wrong_version": json.dumps({**forged, "v": SCHEMA_VERSION + 1}).encode(),
        "out_of_range": json.dumps({**forged, "pid": 4242, "mfu": 3.0}).encode(),
        "too_large": b"x" * 70_000,
    }
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for data in hostile.values():
            s.sendto(data, str(up.run / "telemetry.sock"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = _ranks_view(agent_url)["telemetry"]["rejected"]
        counted = {reason: after[reason] - before[reason] for reason in hostile}
        if all(counted.values()):
            return counted
        time.sleep(0.1)
    raise AssertionError(f"hostile datagrams not all counted: {counted}")


def test_library_names_a_straggler_and_rolls_a_nan_back_to_a_checkpoint_before_it(tmp_path):
    """Rank 1 computes 1.5x as long as rank 0 throughout; in the first run its loss is NaN
    at step 90. The straggler detector judges steps 21+ (warm-up) over a 12-step window
    and names a suspect after 8 more steps and 2.5 s, so rank 1 is named near step 60;
    the NaN then makes the supervisor kill a rank, and the script resumes from step 85,
    its newest validated checkpoint (the save at step 90 holds NaN weights: refused).
    Warm workers (`--warm-start`, trainer/warm.py): the script runs in processes forked
    from a server that imported torch, the killed rank's group is forked again."""
    script, ckpt = tmp_path / "train_client.py", tmp_path / "ckpt"
    script.write_text(SCRIPT)
    up = Up(tmp_path, "--warm-start", "--", str(script), "--ckpt", str(ckpt), "--steps", "150",
            "--slow-rank", "1", "--nan-at", "90")  # fmt: skip
    try:
        counted = _send_hostile_datagrams(up, up.agent_url())
        code = up.wait(timeout=420)
    finally:
        up.close()
    assert counted == dict.fromkeys(counted, 1), counted  # each refused, by its reason
    assert code == 0, up.output()[-4000:]
    log = (up.run / "trainer.log").read_text()
    assert "step 90 checkpoint refused" in log, log[-3000:]
    assert "resumed from step 85" in log and "step 150 loss" in log, log[-3000:]
    assert (up.run / "warm.log").is_file() and "starting cold" not in log  # really warm
    incidents = read_incidents(up.run)
    job = [i for i in incidents if i["job"] == up.run.name]

    stragglers = [i for i in job if i["kind"] == "straggler"]
    assert stragglers and {i["rank"] for i in stragglers} == {1}, incidents
    first = stragglers[0]
    evidence = json.loads(first["evidence"])
    assert 1.3 <= evidence["ratio"] <= 1.8, evidence  # compute 1.5x the peer's
    assert first["step_at_detect"] is not None and first["step_at_detect"] < 90, first
    print(f"straggler named at step {first['step_at_detect']} (ratio {evidence['ratio']:.2f})")

    (nan,) = [i for i in job if i["kind"] == "bad_numerics"]  # not the forged one
    evidence = json.loads(nan["evidence"])
    assert nan["rank"] == 1 and evidence["anomaly_step"] == 90, nan
    assert nan["action"] == "kill_rank" and nan["state"] == "resolved", nan
    assert evidence["checkpoint_step"] == 85 and evidence["checkpoint_predates_anomaly"], nan
    assert nan["step_at_detect"] >= 90 and nan["resumed_step"] == 85, nan
    assert nan["lost_steps"] == nan["step_at_detect"] - 85, nan
    # every validated checkpoint predates the NaN or was written after the restart
    steps = sorted(
        int(m.group(1)) for p in ckpt.iterdir() if (m := re.match(r"step-(\d+)$", p.name))
    )
    assert steps == [140, 145, 150], steps  # keep=3
    assert left_running(up.run) == []
