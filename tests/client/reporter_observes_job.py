"""A 4-rank gloo job (torchrun, CPU) for test_reporter_observes.py: every layout trained a
few steps with and without the Reporter, from the same seed and data; each rank saves its
parameters (local shards), the Reporter's per-step timings and its error counts to
``OUT/rank<r>.pt``. In case ``ddp_stall`` rank 0 is stuck for STALL_SLEEP seconds in step
2 (its peers wait in DDP's all-reduce): the Reporter sends to a socket of the rank's own,
its stall watch reads the flight recorder meanwhile, and what it sent is saved too.

    torchrun --standalone --nproc-per-node=4 reporter_observes_job.py OUT [CASE ...]
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from rankguard.client import Reporter
from rankguard.contract.telemetry import MAX_DATAGRAM_BYTES, decode

STEPS = 3
SEEDS = (1, 2)
STRAGGLER_SLEEP = 0.3  # seconds rank 3 sleeps before each forward (case fsdp_straggler)
STALL_SLEEP = 2.5  # seconds rank 0 is stuck in step 2 (case ddp_stall): a stall is 1 s
ONE_SEED = ("fsdp_straggler", "ddp_stall")  # cases that take seconds: one seed


def halving_hook(group, bucket):
    """A user's comm hook whose effect shows in the result: DDP's average, halved."""
    t = bucket.buffer().div_(group.size())
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] * 0.5)


class CountingAllGather:
    """A user's custom FSDP2 all-gather: it must still be the one called."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def train(
    model, seed: int, data_key: int, rg: Reporter | None, sleep: float = 0.0, stall: float = 0.0
) -> dict:
    """`sleep`: before every forward; `stall`: before step 2's forward."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1000 * seed + data_key)  # each data key its own data
    for n in range(1, STEPS + 1):
        x = torch.randn(8, 16, generator=g)
        s = rg.step(n) if rg else None
        if s:
            s.phase("compute")
        time.sleep(sleep + (stall if n == 2 else 0.0))
        model(x).square().mean().backward()
        if s:
            s.phase("optimizer")
        opt.step()
        opt.zero_grad()
    if rg:
        rg.close()
    # the optimizer's: DDP + TP leaves the module's own list empty after a forward
    params = opt.param_groups[0]["params"]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return {
        "params": [p.detach().clone() for p in local],
        "comm": [t.comm_seconds for t in rg.timings] if rg else [],
        "exposed": [t.comm_exposed_seconds for t in rg.timings] if rg else [],
        "compute": [t.compute_seconds for t in rg.timings] if rg else [],
        "errors": dict(rg.errors) if rg else {},
    }


def reporter(model, variant: str = "reporter") -> Reporter | None:
    """A Reporter on `model` for the "reporter" variant; none for the others."""
    if variant != "reporter":
        return None
    return Reporter(model, socket_path=None, heartbeat_seconds=0)


class Received:
    """A socket of the rank's own, standing in for the agent's: every record sent to it."""

    def __init__(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.path, self.records = path, []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.stop.is_set():
            try:
                self.records.append(decode(self.sock.recv(MAX_DATAGRAM_BYTES + 1)))
            except TimeoutError:
                continue

    def close(self) -> list:
        time.sleep(0.2)
        self.stop.set()
        self.thread.join()
        self.sock.close()
        return self.records


def run_case(
    case: str, seed: int, rank: int, groups: dict, meshes: dict, out_dir: Path | None = None
) -> dict:
    """{variant: result} for one layout and seed."""
    out = {}
    if case in ("ddp_groups", "ddp_groups3"):  # DDP over DP sub-groups, each its own data
        group = groups[case]
        for variant in ("plain", "reporter"):
            ddp = DDP(net(seed), process_group=group)
            out[variant] = train(ddp, seed, rank, reporter(ddp, variant))
    elif case == "ddp_user_hook":
        group = groups["ddp_groups"]
        for variant in ("plain", "hook", "hook_then_reporter", "reporter_then_hook"):
            ddp = DDP(net(seed), process_group=group)
            rg = reporter(ddp) if variant == "reporter_then_hook" else None
            if variant != "plain":
                ddp.register_comm_hook(group, halving_hook)
            if variant == "hook_then_reporter":
                rg = reporter(ddp)
            out[variant] = train(ddp, seed, rank, rg)
    elif case in ("fsdp", "hsdp", "fsdp_custom_comm"):
        for variant in ("plain", "reporter"):
            model = net(seed)
            for layer in (model[0], model[2], model):
                fully_shard(layer, mesh=meshes.get(case, meshes["fsdp"]))
            comm = CountingAllGather()
            if case == "fsdp_custom_comm":
                for layer in (model[0], model[2]):
                    layer.set_custom_all_gather(comm)
            out[variant] = train(model, seed, rank, reporter(model, variant))
            out[variant]["custom_calls"] = comm.calls
    elif case in ("tp_ddp", "tp_fsdp"):  # 2D: TP inside each DP replica
        mesh = meshes["dp_tp"]
        for variant in ("plain", "reporter"):
            model = parallelize_module(
                net(seed), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
            )
            if case == "tp_ddp":
                model = DDP(model, device_mesh=mesh["dp"])
            else:
                fully_shard(model, mesh=mesh["dp"])
            # the ranks of one TP group must see the same batch
            out[variant] = train(model, seed, mesh["dp"].get_local_rank(), reporter(model, variant))
    elif case == "ddp_stall":  # rank 0 stuck in step 2: a stall watch reads the recorders
        stall = STALL_SLEEP if rank == 0 else 0.0
        for variant in ("plain", "reporter"):
            ddp = DDP(net(seed))
            if variant == "plain":
                out[variant] = train(ddp, seed, rank, None, stall=stall)
                continue
            received = Received(out_dir / f"rank{rank}.sock")
            rg = Reporter(ddp, socket_path=str(received.path), heartbeat_seconds=0)
            out[variant] = train(ddp, seed, rank, rg, stall=stall)
            out[variant]["evidence"] = [  # (the step it was in after, its wavefront)
                (r.step, [c.to_json() for c in r.collectives or ()])
                for r in received.close()
                if not r.progress
            ]
    elif case == "fsdp_straggler":  # rank 3 late to every step: its peers wait in forward
        model = net(seed)
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=meshes["fsdp"])
        sleep = STRAGGLER_SLEEP if rank == 3 else 0.0
        out["reporter"] = train(model, seed, rank, reporter(model), sleep=sleep)
    else:
        raise SystemExit(f"unknown case {case}")
    return out


def main() -> None:
    out_dir, cases = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # every rank creates every group, in the same order (new_group is collective)
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    g012, g3 = dist.new_group([0, 1, 2]), dist.new_group([3])
    groups = {
        "ddp_groups": g01 if rank < 2 else g23,
        "ddp_groups3": g012 if rank < 3 else g3,  # 1/3 is not exact: DDP's own arithmetic
    }
    meshes = {
        "fsdp": init_device_mesh("cpu", (4,)),
        "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
        "dp_tp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
    }
    results = {}
    for case in cases:
        for seed in SEEDS[:1] if case in ONE_SEED else SEEDS:
            results[(case, seed)] = run_case(case, seed, rank, groups, meshes, out_dir)
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
