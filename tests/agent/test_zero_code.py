"""Zero-code protection end to end: `rankguard up --nproc 2 -- script.py` with a plain DDP
script that imports nothing from rankguard (gloo on the CPU, its own torch.save
checkpoints and resume). A SIGKILLed and a SIGSTOPped worker are each an incident naming
the rank, the job restarts through torchrun and completes (exit 0); a script that crashes
at import is a clear error (exit 1) with nothing left running."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from up_run import Up, agent_rank, left_running, log_has, read_incidents

from rankguard.contract import exit_codes

pytestmark = pytest.mark.slow

SCRIPT = """
import argparse, os, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--ckpt", required=True)
p.add_argument("--ckpt-every", type=int, default=5)
p.add_argument("--stall-at", type=int, default=-1)
p.add_argument("--crash-at", type=int, default=-1)  # rank 1, in every incarnation
args = p.parse_args()


def stuck_in_user_code():  # a rank that never reaches the next collective
    time.sleep(3600)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
start = 0
if os.path.exists(args.ckpt):
    state = torch.load(args.ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = int(state["step"])
    if rank == 0:
        print(f"resumed from step {start}", flush=True)
ddp = DDP(model)
for step in range(start, args.steps):
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(16, 8, generator=g)
    loss = F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    busy_until = time.perf_counter() + 0.05
    while time.perf_counter() < busy_until:  # pretend compute: training uses CPU
        pass
    time.sleep(0.05)
    if step == args.stall_at and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        stuck_in_user_code()
    if step == args.crash_at and rank == 1:
        os._exit(1)
    if rank == 0 and (step + 1) % args.ckpt_every == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                   args.ckpt + ".tmp")
        os.replace(args.ckpt + ".tmp", args.ckpt)
    if rank == 0:
        print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train_plain.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_plain_ddp_script_recovers_from_a_dead_or_stopped_worker(tmp_path, fault):
    script, ckpt = _script(tmp_path), tmp_path / "ckpt.pt"
    up = Up(tmp_path, "--", str(script), "--ckpt", str(ckpt))
    try:
        url = up.agent_url()
        log_has(up, r"step 15 ", timeout=240)  # a checkpoint at step 15 exists
        target = agent_rank(url, up.run.name, 1)
        assert target["source"] == "process" and target["step"] is None
        os.kill(target["pid"], getattr(signal, fault))
        faulted_at = time.time()
        code = up.wait(timeout=400)
    finally:
        up.close()
    assert code == 0, up.output()[-4000:]
    assert "training completed" in up.output()
    log = (up.run / "trainer.log").read_text()
    assert re.search(r"resumed from step (1[5-9]|[2-9]\d)", log), log[-3000:]
    assert "step 60 " in log
    incidents = read_incidents(up.run)
    kind = "rank_dead" if fault == "SIGKILL" else "rank_hung"
    mine = [i for i in incidents if i["kind"] == kind and i["job"] == up.run.name]
    assert mine and mine[0]["rank"] == 1, incidents
    first = mine[0]
    print(f"{fault}: fault to incident {first['detected_at'] - faulted_at:.2f} s")
    if fault == "SIGKILL":
        assert first["detected_at"] - faulted_at < 2.0, first  # ~0.3 s on a quiet machine
    else:
        assert first["detected_at"] - faulted_at < 6.0, first  # the 2 s stop budget + a pass
        assert first["action"] == "kill_rank", first
        evidence = json.loads(first["evidence"])
        assert "stopped" in evidence["culprit_reason"]
        with sqlite3.connect(up.run / "rankguard.db") as db:
            (result,) = db.execute(
                "SELECT result FROM actions WHERE incident_id = ? AND kind = 'kill_rank'",
                (first["id"],),
            ).fetchone()
        assert "train_plain.py" in json.loads(result)["stacks"]["1"]  # py-spy of the culprit
    assert left_running(up.run) == []


def test_ranks_without_cpu_progress_the_stacks_name_the_culprit(tmp_path):
    """Rank 1 sleeps in user code at step 16; rank 0 waits in DDP's all-reduce. Neither
    uses CPU, so after --process-idle-seconds the supervisor reads both stacks (py-spy),
    names rank 1 (the only one not in a collective), kills it, and the job resumes."""
    script, ckpt = _script(tmp_path), tmp_path / "ckpt.pt"
    up = Up(tmp_path, "--process-idle-seconds", "6", "--", str(script), "--ckpt", str(ckpt),
            "--stall-at", "16")  # fmt: skip
    try:
        code = up.wait(timeout=400)
    finally:
        up.close()
    assert code == 0, up.output()[-4000:]
    incidents = read_incidents(up.run)
    hung = [i for i in incidents if i["kind"] == "rank_hung"]
    assert len(hung) == 1 and hung[0]["rank"] == 1, incidents
    assert hung[0]["action"] == "kill_rank"
    with sqlite3.connect(up.run / "rankguard.db") as db:
        (result,) = db.execute(
            "SELECT result FROM actions WHERE incident_id = ? AND kind = 'kill_rank'",
            (hung[0]["id"],),
        ).fetchone()
    # the stacks that named it (in the incident), or the culprit's, taken before the kill
    assert "stuck_in_user_code" in hung[0]["evidence"] + (result or ""), hung[0]
    log = (up.run / "trainer.log").read_text()
    assert "resumed from step 15" in log and "step 60 " in log
    assert left_running(up.run) == []


def test_a_script_that_dies_soon_after_every_start_is_stopped_as_a_crash_loop(tmp_path):
    """A zero-code script reports no checkpoint: incarnations that each die within
    `crash_loop_progress_seconds` of the restart before are the loop (here every one
    resumes from step 15 and dies at step 18)."""
    script, ckpt = _script(tmp_path), tmp_path / "ckpt.pt"
    up = Up(tmp_path, "--", str(script), "--ckpt", str(ckpt), "--crash-at", "17")
    try:
        code = up.wait(timeout=400)
    finally:
        up.close()
    err = "".join(up.err)
    assert code == exit_codes.USER_ERROR.code, up.output()[-4000:]
    verdict = "crash loop: 3 restarts without checkpoint progress (no validated checkpoint)"
    assert f"{verdict}, the incarnations between them each under 600 s" in err, err[-2000:]
    incidents = read_incidents(up.run)
    kinds = [i["kind"] for i in incidents]
    stop = kinds.index("crash_loop")
    assert kinds[:stop] == ["rank_dead"] * 3, kinds
    log = (up.run / "trainer.log").read_text()
    assert re.findall(r"resumed from step (\d+)", log) == ["15", "15"], log[-3000:]
    assert left_running(up.run) == []


def test_a_script_that_crashes_at_import_is_a_clear_error(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import no_such_module_for_rankguard_tests  # noqa\n")
    up = Up(tmp_path, "--max-restarts", "1", "--", str(script))
    try:
        code = up.wait(timeout=240)
    finally:
        up.close()
    err = "".join(up.err)
    assert code == exit_codes.USER_ERROR.code, up.output()[-3000:]  # failed at start
    assert "training failed" in err
    # two ranks write their tracebacks to one log at once: lines may interleave
    assert "ModuleNotFoundError" in err and "no_such_module_for_rankguard_tests" in err
    assert left_running(up.run) == []


def test_up_refuses_trainer_options_with_a_script(tmp_path):
    script = _script(tmp_path)
    env = {**os.environ, "COLUMNS": "300"}
    base = [sys.executable, "-m", "rankguard.cli.main", "up", "--run-dir", str(tmp_path / "r")]
    proc = subprocess.run(
        [*base, "--steps", "5", "--", str(script)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "only for the bundled trainer" in proc.stderr
    proc = subprocess.run(
        [*base, "--", str(tmp_path / "missing.py")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "no such file" in proc.stderr
    proc = subprocess.run(
        [*base, "--inject", "nan:rank=1", "--", str(script)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 2 and "with a script only kill, stop" in proc.stderr
