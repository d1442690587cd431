"""What a DDP comm hook costs on a GPU, by part: DDP's built-in all-reduce against the
timed hook of rankguard.client, a hook that averages with a separate `div_` pass, and a
timed hook without any division, side by side in one process (one rank, NCCL).

    python bench/ddp_hook_cost.py [--rounds 40] [--width 4096] [--batch 2048]

Each round runs 5 steps of every variant (the order reversed every other round) and keeps
the fastest; the table gives the median over rounds and the ratio to the built-in path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2048)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankguard.client import StepTimer, timed_allreduce_hook

    if not torch.cuda.is_available():
        print("ddp_hook_cost: needs a CUDA GPU; nothing measured")
        return 0
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29556"), ("RANK", "0"),
                       ("WORLD_SIZE", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    w = args.width

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)).to(dev)
        return DDP(net, device_ids=[0])

    def dividing_hook(_state, bucket):  # what an averaging hook without AVG does
        world = dist.get_world_size()
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    models = {"built-in": build(), "rankguard hook": build(), "div_ + all_reduce hook": build()}
    models["rankguard hook"].register_comm_hook(StepTimer(dev), timed_allreduce_hook)
    models["div_ + all_reduce hook"].register_comm_hook(None, dividing_hook)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = torch.randn(args.batch, w, device=dev)
    y = torch.randn(args.batch, w, device=dev)

    def step(name: str) -> None:
        loss = nn.functional.mse_loss(models[name](x), y)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    for name in models:
        for _ in range(3):
            step(name)
    torch.cuda.synchronize()
    fastest: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name in list(models)[:: -1 if r % 2 else 1]:
            block = []
            for _ in range(5):
                t0 = time.perf_counter()
                step(name)
                torch.cuda.synchronize()
                block.append(time.perf_counter() - t0)
            fastest[name].append(min(block))
    base = statistics.median(fastest["built-in"])
    print(f"{torch.cuda.get_device_name(0)}; Linear({w}, {4 * w}) + GELU + Linear({4 * w}, {w}), "
          f"batch {args.batch}, {args.rounds} rounds\n")  # fmt: skip
    print("| variant | step ms | ratio to built-in |\n|---|---:|---:|")
    for name, times in fastest.items():
        ms = statistics.median(times)
        print(f"| {name} | {ms * 1e3:.3f} | {ms / base:.4f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
