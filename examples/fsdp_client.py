"""An FSDP2 training script (torchrun; gloo on CPU, NCCL on GPUs): examples/fsdp_plain.py as
is, examples/fsdp_client.py with rankguard.client (the lines marked `# rankguard`: steps
with their phases, loss, tokens, all-gather/reduce-scatter time, validated checkpoints).

    torchrun --standalone --nproc-per-node=2 examples/fsdp_client.py --steps 50 --ckpt ckpt

Each linear layer and the whole model are sharded with `fully_shard`. A checkpoint is the
full (unsharded) model and optimizer state, gathered on every rank and written by rank 0;
after a restart every rank resumes from it.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from rankguard.client import CheckpointStore, Reporter  # rankguard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Checkpoints:
    """The script's own checkpoints: one file, replaced atomically."""

    def __init__(self, path: str) -> None:
        self.path = path

    def save(self, step: int, state: dict) -> None:
        tmp = f"{self.path}.tmp"
        torch.save({"step": step, "state": state}, tmp)
        os.replace(tmp, self.path)

    def resume(self, **torch_load) -> tuple[int, dict | None]:
        """(step, state) of the last save, or (0, None); every rank reads the same file."""
        if not os.path.exists(self.path):
            return 0, None
        saved = torch.load(self.path, **torch_load)
        return saved["step"], saved["state"]


def batches(batch: int, width: int, device: torch.device, start: int):
    g = torch.Generator().manual_seed(1000 * start + int(os.environ.get("RANK", "0")))
    while True:
        x = torch.randn(batch, width, generator=g)
        yield x.to(device), x.flip(1).to(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--ckpt", default="fsdp.pt")
    p.add_argument("--extra-compute", type=float, default=0.0, help="seconds per step (a pause)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(args.width, 4 * args.width), nn.GELU(), nn.Linear(4 * args.width, args.width)
    ).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rg = Reporter(model)  # rankguard: times FSDP2's all-gathers and reduce-scatters
    ckpt = CheckpointStore(args.ckpt, keep=3, reporter=rg)  # rankguard: validated
    start, state = ckpt.resume(weights_only=True)
    if state is not None:
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["opt"], options=FULL)  # fmt: skip
        if dist.get_rank() == 0:
            print(f"resumed from step {start}", flush=True)
    data = batches(args.batch, args.width, device, start)
    for step in range(start + 1, args.steps + 1):
        s = rg.step(step, tokens=args.batch)  # rankguard
        x, y = next(data)
        s.phase("compute")  # rankguard
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        time.sleep(args.extra_compute)  # stands in for a bigger model on a small machine
        s.phase("optimizer")  # rankguard
        opt.step()
        opt.zero_grad(set_to_none=True)
        s.loss(loss)  # rankguard
        if step % args.save_every == 0:
            model_state, opt_state = get_state_dict(model, opt, options=FULL)  # every rank
            if dist.get_rank() == 0:
                ckpt.save(step, {"model": model_state, "opt": opt_state})
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    # wait for rank 0's last save: a rank that tears gloo down alone while its peer is
    # still connected can abort at exit (std::terminate, seen in 5 of 18 resumed runs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
