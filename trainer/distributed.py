"""Process group set-up from torchrun's environment, and model wrapping (DDP or FSDP2)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("rankguard.trainer")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    device: torch.device
    ckpt_group: object  # a separate gloo group so background saves never interleave with DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attempt_store(environ, rank: int, world_size: int, restart_count: int) -> dist.Store:
    """The rendezvous store, namespaced by torchrun's restart count when it is shared.

    torchrun's c10d rendezvous shares one TCPStore across restarts, so without a
    per-attempt prefix a restarted worker can read the dead incarnation's gloo
    addresses and fail or hang in init_process_group. The restart count is not the same
    on every node after a membership change (torchrun does not count those restarts), so
    multi-node elastic jobs should run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the
    round's rank 0 then hosts a fresh store (a new port every round), nothing in it is
    stale, and it is used without a prefix, whatever each node's restart count says.
    """
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_store and rank == 0,
        multi_tenant=True,
    )
    if not agent_store:
        return store
    return dist.PrefixStore(f"rankguard/attempt-{restart_count}", store)


NCCL_BACKEND = "cpu:gloo,cuda:nccl"  # NCCL for CUDA tensors, gloo for async checkpointing
GPU_KEY = "rankguard/gpu-uuid"


def backend_for(uuids: list[str | None]) -> tuple[str, str | None]:
    """The process group's backend from every rank's GPU UUID (index = rank), and why
    gloo when it is gloo. NCCL refuses two ranks on one physical GPU, and only the UUID
    says whether two ranks share one: `CUDA_VISIBLE_DEVICES` set per rank (Slurm's
    --gpus-per-task) leaves each rank seeing one device, `cuda:0`, yet each its own GPU."""
    if any(u is None for u in uuids):
        missing = [r for r, u in enumerate(uuids) if u is None]
        return "gloo", f"rank(s) {missing[:8]} have no GPU"
    first: dict[str, int] = {}
    for rank, uuid in enumerate(uuids):
        if uuid in first:
            return "gloo", f"ranks {first[uuid]} and {rank} share GPU {uuid}"
        first[uuid] = rank
    return NCCL_BACKEND, None


def agree_backend(
    store: dist.Store, rank: int, world_size: int, uuid: str | None
) -> tuple[str, str | None]:
    """Every rank's GPU UUID through the store, one backend for all: each rank writes its
    own key, rank 0 reads them all and decides, the others read the decision (O(ranks) in
    all, not a read of every key by every rank)."""
    store.set(f"{GPU_KEY}/{rank}", uuid or "")
    if rank == 0:
        keys = [f"{GPU_KEY}/{r}" for r in range(world_size)]
        store.wait(keys)
        uuids = [v.decode() or None for v in store.multi_get(keys)]
        backend, why = backend_for(uuids)
        store.set(f"{GPU_KEY}/backend", f"{backend}\n{why or ''}")
    backend, _, why = store.get(f"{GPU_KEY}/backend").decode().partition("\n")
    return backend, why or None


def init_distributed(
    environ=os.environ, device_uuid=None, timeout: float | None = None
) -> DistInfo:
    """Join torchrun's process group; without torchrun, become a group of one. `timeout`:
    the groups' collective timeout in seconds (None: torch's default)."""
    if "RANK" not in environ:  # plain `python -m rankguard.trainer`
        environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    rank, local_rank = int(environ["RANK"]), int(environ["LOCAL_RANK"])
    world_size = int(environ["WORLD_SIZE"])
    local_world = int(environ.get("LOCAL_WORLD_SIZE", world_size))
    restart_count = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    store = _attempt_store(environ, rank, world_size, restart_count)
    pg_timeout = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if torch.cuda.is_available():
        from ..client.gpu_identity import device_uuid as uuid_of

        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # Async checkpointing needs a CPU backend too; ranks that share a physical GPU
        # (by UUID) all-reduce through gloo, as NCCL refuses two ranks on one GPU.
        uuid = (device_uuid or uuid_of)(device)
        backend, why = agree_backend(store, rank, world_size, uuid)
        if why and rank == 0:
            log.warning("%s: gloo instead of NCCL for every rank", why)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Share the cores between the ranks of this node instead of oversubscribing,
        # unless the job set its own count (as a warm-started worker honours it).
        omp = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(
            int(omp)
            if omp.isdigit() and int(omp) > 0
            else max(1, (os.cpu_count() or 1) // local_world)
        )
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        device_id=device if backend != "gloo" and device.type == "cuda" else None,
        **pg_timeout,
    )
    ckpt_group = dist.new_group(backend="gloo", **pg_timeout)
    return DistInfo(rank, local_rank, world_size, local_world, restart_count, device, ckpt_group)


def wrap_model(
    model: nn.Module, info: DistInfo, fsdp: bool, timer, wait_mode: str = "block"
) -> nn.Module:
    """DDP with the timed all-reduce hook (on DDP's own group, with DDP's arithmetic), or
    FSDP2 `fully_shard` per block with timed all-gathers and reduce-scatters. `wait_mode`
    "spin": DDP's all-reduce is waited by busy-polling (trainer/spin_wait.py)."""
    from ..client import attach_ddp, attach_fsdp

    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if attach_fsdp(timer, model) == 0:
            log.warning("FSDP2 communication is not timed (no custom-collective API)")
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    reasons: list[str] = []
    if not attach_ddp(timer, ddp, reasons):  # DDP as it is, untimed: never a changed job
        log.warning("DDP communication is not timed: %s", ", ".join(reasons))
    if wait_mode == "spin":
        from .spin_wait import SpinningAllreduce, spinning_allreduce_hook

        # After attach_ddp: the timing keeps this hook as the user's and runs it inside
        # its own, timed (one registered before would leave DDP untimed).
        ddp.register_comm_hook(SpinningAllreduce(ddp.process_group), spinning_allreduce_hook)
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def agree_incarnation(ckpt_dir, info: DistInfo) -> int:
    """One incarnation number for every rank of this start, growing with every start: rank
    0 claims it in the shared checkpoint directory and broadcasts it. It is what the
    telemetry reports as `restart`, so the supervisor groups the ranks of one start
    together on every node. Without a checkpoint directory (or when it cannot be
    written) rank 0's torchrun restart count is used, still the same on every rank."""
    value = info.restart_count
    if info.rank == 0 and ckpt_dir is not None:
        from ..client.checkpoint_store import claim_incarnation

        try:
            value = claim_incarnation(ckpt_dir, at_least=value)
        except OSError as exc:
            log.warning("incarnation number: %s; using the restart count %d", exc, value)
    if info.world_size > 1:
        t = torch.tensor([value], dtype=torch.int64, device=info.device)
        dist.broadcast(t, src=0)
        value = int(t.item())
    return value
