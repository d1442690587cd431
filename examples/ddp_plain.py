"""A plain PyTorch DDP training script: it imports nothing from rankguard.

It is what `rankguard up --nproc 2 -- examples/ddp_plain.py` protects without any change
(zero-code protection): the agent finds its torchrun workers by process, a dead or stopped
rank becomes an incident, and torchrun restarts the group, which resumes from the script's
own checkpoint. Run it alone with `torchrun --nproc-per-node 2 examples/ddp_plain.py`.

gloo on the CPU (NCCL when CUDA is there), a tiny regression model, a checkpoint every
--ckpt-every steps written by rank 0 with torch.save (to a temporary file, then renamed,
so a crash mid-save never leaves a torn checkpoint), and resume from it at every start.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt", default="runs/ddp_plain/checkpoint.pt")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-work", type=float, default=0.05, help="seconds of pretend compute")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)

    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * world + rank)  # data: a function of the step
        x = torch.randn(64, 16, generator=g).to(device)
        y = x.sum(dim=1, keepdim=True)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        busy_until = time.perf_counter() + args.step_work
        while time.perf_counter() < busy_until:  # pretend compute (training uses CPU or GPU)
            pass
        done = step + 1
        if rank == 0 and done % args.ckpt_every == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.ckpt)), exist_ok=True)
            tmp = f"{args.ckpt}.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, tmp)
            os.replace(tmp, args.ckpt)
        if rank == 0 and done % 10 == 0:
            print(f"step {done} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"finished {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
