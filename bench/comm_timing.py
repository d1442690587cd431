"""Communication timing: the trainer's DDP comm-hook figure against torch.profiler on the
same steps, and the effect of a sleep injected into every all-reduce.

    torchrun --standalone --nproc-per-node 2 bench/comm_timing.py [--delay 0.02] [--json OUT]

Rank 0 prints a table. "hook" is what rankguard reports (`comm_seconds`: wall time an
all-reduce was in flight); "profiler" is the sum of the process group's all_reduce
events torch.profiler recorded on the same steps.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from rankguard.client import StepTimer
from rankguard.trainer.config import ModelConfig
from rankguard.trainer.distributed import init_distributed, wrap_model
from rankguard.trainer.model import GPT


def measure(model, timer: StepTimer, batch, steps: int, delay: float, cuda: bool) -> dict:
    x, y = batch
    timer.comm_delay_seconds = delay
    for _ in range(2):  # warm-up: DDP rebuilds its buckets after the first step
        model(x, y).backward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for step in range(steps):
            timer.begin(step)
            timer.mark("compute_start")
            model(x, y).backward()
            timer.mark("backward_end")
            timer.mark("optimizer_end")
            timer.end()
            model.zero_grad(set_to_none=True)
    timings = timer.ready(flush=True)
    collective = [
        e
        for e in prof.events()
        if "all_reduce" in e.name and ("gloo" in e.name or "nccl" in e.name)
    ]
    # NCCL runs on the GPU (its kernels' time); gloo on the host, also with CUDA tensors. An
    # NCCL all-reduce at world size 1 may launch no kernel at all: then its host time.
    device_us = sum(e.device_time_total for e in collective if "nccl" in e.name)
    host_us = sum(e.cpu_time_total for e in collective)
    profiler_clock = "device" if device_us > 0 else "host"
    return {
        "delay_seconds": delay,
        "steps": steps,
        # Means compare with the profiler's totals; medians resist a step that waited on a peer.
        "hook_comm_ms": 1e3 * statistics.fmean(t.comm_seconds for t in timings),
        "hook_comm_median_ms": 1e3 * statistics.median(t.comm_seconds for t in timings),
        "profiler_comm_ms": (device_us if device_us > 0 else host_us) / 1e3 / steps,
        "profiler_clock": profiler_clock,
        "compute_ms": 1e3 * statistics.median(t.compute_seconds for t in timings),
        "comm_compute_ratio": statistics.median(t.comm_compute_ratio for t in timings),
        "allreduce_calls_per_step": len(collective) / steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--delay", type=float, default=0.02, help="seconds added to each all-reduce")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", help="rank 0 writes the results here")
    args = p.parse_args()

    info = init_distributed()
    cuda = info.device.type == "cuda"
    torch.manual_seed(0)
    cfg = ModelConfig(args.layers, 4, args.d_model, 128, 256)
    timer = StepTimer(info.device)
    model = wrap_model(GPT(cfg).to(info.device), info, fsdp=False, timer=timer)
    x = torch.randint(0, 256, (4, 128), device=info.device)
    batch = (x, torch.roll(x, -1, dims=1))
    rows = [measure(model, timer, batch, args.steps, d, cuda) for d in (0.0, args.delay)]
    if info.rank == 0:
        base, delayed = rows
        per_step = delayed["hook_comm_median_ms"] - base["hook_comm_median_ms"]
        per_call = per_step / max(1, base["allreduce_calls_per_step"])
        result = {
            "device": str(info.device),
            "backend": str(dist.get_backend()),
            "world_size": info.world_size,
            "params": sum(p.numel() for p in model.parameters()),
            "rows": rows,
            "hook_over_profiler": base["hook_comm_ms"] / base["profiler_comm_ms"]
            if base["profiler_comm_ms"]
            else None,  # the profiler saw no collective
            "added_ms_per_allreduce": per_call,
            # The delays of a step's buckets may overlap (their callbacks can run at once),
            # so a step gains at least one delay and at most one per all-reduce.
            "added_ms_per_step": per_step,
            "injected_ms_per_allreduce": 1e3 * args.delay,
            "ratio_increase": delayed["comm_compute_ratio"] / max(1e-9, base["comm_compute_ratio"]),
        }
        print(f"{'injected delay':>15} {'hook comm ms':>13} {'profiler ms':>12} {'hook/prof':>10} "
              f"{'compute ms':>11} {'comm/compute':>13}")  # fmt: skip
        for r in rows:
            ratio = r["hook_comm_ms"] / r["profiler_comm_ms"] if r["profiler_comm_ms"] else 0.0
            print(f"{r['delay_seconds'] * 1e3:>12.1f} ms {r['hook_comm_ms']:>13.2f} "
                  f"{r['profiler_comm_ms']:>12.2f} {ratio:>10.2f} "
                  f"{r['compute_ms']:>11.2f} {r['comm_compute_ratio']:>13.3f}")  # fmt: skip
        print(f"added per all-reduce: {per_call:.2f} ms (injected {1e3 * args.delay:.2f} ms); "
              f"comm/compute ratio x{result['ratio_increase']:.2f}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    # a rank tearing gloo down alone, its peer still connected, can abort at exit (std::terminate)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
