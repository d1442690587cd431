"""Zero-code hangs as NCCL jobs hang, end to end: `rankguard up --nproc 2 -- script.py`
with a plain script (no rankguard import) whose rank 1 gets stuck three ways, one per
incarnation: in Python before its collective, in its DataLoader, in native code (GIL
released). Its peer waits in the gradient all-reduce busy-polling (`spin`: the CPU
stand-in for a rank waiting on NCCL, never idle; a peer blocked in the kernel, gloo's way,
is what the other zero-code hang tests run, and bench/hang_soak.py runs both ways). The
workers' collective watch (started by `up`'s bootstrap on their PYTHONPATH) sends the
flight-recorder wavefronts; the supervisor names rank 1 from them within 30 s each time.
After the third hang in a row without checkpoint progress the crash-loop guard stops the
job (zero-code scripts report no checkpoint), which ends the run quickly."""

from __future__ import annotations

import re

import pytest
from up_run import Up, left_running, read_incidents

pytestmark = pytest.mark.slow

SCRIPT = """
import argparse, hashlib, os, time
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--ckpt", required=True)
p.add_argument("--wait-mode", choices=["block", "spin"], default="block")
p.add_argument("--fault", action="append", default=[])  # KIND:STEP:INCARNATION, rank 1
args = p.parse_args()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
fault = {}
for spec in args.fault:
    kind, step, incarnation = spec.split(":")
    if rank == 1 and int(incarnation) == restart:
        fault[int(step)] = kind


def stuck(kind):
    print(f"fault {kind} at {time.time():.3f}", flush=True)
    if kind == "python":  # a loop that never reaches the next collective
        while True:
            pass
    while True:  # native code with the GIL released, as a stuck CUDA or driver call
        hashlib.pbkdf2_hmac("sha256", b"rankguard", b"stuck", 200_000)


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return args.steps

    def __getitem__(self, step):
        if fault.get(step) == "dataloader":
            print(f"fault dataloader at {time.time():.3f}", flush=True)
            time.sleep(3600)
        g = torch.Generator().manual_seed(step * world + rank)
        return torch.randn(16, 8, generator=g)


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(args.ckpt):
    state = torch.load(args.ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    start = int(state["step"])
loader = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=1,
                                     sampler=range(start, args.steps))
for step, x in zip(range(start, args.steps), loader):
    if fault.get(step) in ("python", "native"):
        stuck(fault[step])
    loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    flat = torch.cat([q.grad.flatten() for q in model.parameters()])
    work = dist.all_reduce(flat, async_op=True)
    if args.wait_mode == "spin":  # as a host thread in CUDA's spin-wait
        while not work.is_completed():
            os.sched_yield()
    work.wait()
    torch.nn.utils.vector_to_parameters(flat / world, [q.grad for q in model.parameters()])
    opt.step()
    time.sleep(0.1)
    if rank == 0 and (step + 1) % 5 == 0:
        torch.save({"model": model.state_dict(), "step": step + 1}, args.ckpt + ".tmp")
        os.replace(args.ckpt + ".tmp", args.ckpt)
    if rank == 0:
        print(f"step {step + 1}", flush=True)
dist.destroy_process_group()
"""
FAULTS = ("python:12:0", "dataloader:17:1", "native:22:2")


def test_zero_code_hangs_are_named_from_the_flight_recorders(tmp_path):
    script = tmp_path / "train_plain.py"
    script.write_text(SCRIPT)
    faults = [a for f in FAULTS for a in ("--fault", f)]
    up = Up(tmp_path, "--max-restarts", "4", "--", str(script), "--ckpt",
            str(tmp_path / "ckpt.pt"), "--wait-mode", "spin", *faults)  # fmt: skip
    try:
        code = up.wait(timeout=400)
    finally:
        up.close()
    log = (up.run / "trainer.log").read_text()
    at = {k: float(t) for k, t in re.findall(r"fault (\w+) at ([\d.]+)", log)}
    assert set(at) == {"python", "dataloader", "native"}, log[-3000:]
    incidents = read_incidents(up.run)
    hung = sorted((i for i in incidents if i["kind"] == "rank_hung"), key=lambda i: i["id"])
    assert len(hung) == 3, (code, incidents, up.output()[-3000:])
    for inc, kind in zip(hung, ("python", "dataloader", "native"), strict=True):
        took = inc["detected_at"] - at[kind]
        print(f"{kind}: fault to incident {took:.1f} s")
        assert inc["rank"] == 1, inc
        assert "wavefront" in inc["evidence"] and '"behind"' in inc["evidence"], inc
        assert 0 < took < 30, (kind, took, inc)
    assert left_running(up.run) == []
    assert code in (0, 3), up.output()[-3000:]
