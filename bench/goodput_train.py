"""The goodput benchmark's training script: one DDP job, the same under every stack.

    torchrun --nproc-per-node=2 bench/goodput_train.py --steps 600 --ckpt-dir D \\
        --progress P.jsonl --faults F/

A small MLP (same seed, model and batches everywhere), its own periodic checkpoints through
rankguard.client's CheckpointStore (validated, quarantined when corrupt) and a Reporter
(harmless without an agent: datagrams to nowhere are counted and dropped). Under
nvidia-resiliency-ext's ft_launcher it also sends that extension's heartbeats (guarded
import). With --snapshot-holder it keeps tier-0 in-memory snapshots as well
(rankguard.client.snapshots) and resumes from the newest one every rank can fetch.

In-process faults come through files, the same for every stack: the injector
(bench/goodput.py) writes FAULTS/<id>.json; the rank it names claims it by creating
FAULTS/<id>.claim (O_EXCL, so a restarted rank never applies it twice), applies it and
writes FAULTS/<id>.taken with the time it took effect:
hang (spins in Python), slow (each step takes FACTOR x as long, for SECONDS), nan (this
step's loss is NaN), stall (the next checkpoint write blocks SECONDS). Signals and
checkpoint corruption are done to the job from outside.

Rank 0 appends one JSON line per event to --progress: start, resume (step and where
from), step (every step, with its loss), done. bench/goodput.py reads nothing else.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from rankguard.client import CheckpointStore, Reporter

try:  # nvidia-resiliency-ext: only under its ft_launcher (it sets the env it reads)
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
except Exception:  # noqa: BLE001 - absent, or failing to import on this machine
    RankMonitorClient = None


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--progress", required=True)
    p.add_argument("--faults", required=True)
    p.add_argument("--snapshot-holder", default=None)
    p.add_argument("--snapshot-peers", default="")
    p.add_argument("--snapshot-every", type=int, default=2)
    return p.parse_args()


class Faults:
    """The file trigger: claims the faults meant for this rank, once each."""

    def __init__(self, root: str, rank: int):
        self.root, self.rank = root, rank
        self.slow_until = 0.0
        self.slow_factor = 1.0
        self.stall = 0.0
        self.nan = False
        self.stall_marker = ""

    def poll(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.root) if n.endswith(".json"))
        except OSError:
            return
        for name in names:
            path = os.path.join(self.root, name)
            try:
                with open(path) as f:
                    fault = json.load(f)
            except (OSError, ValueError):
                continue
            if fault.get("rank") != self.rank:
                continue
            try:  # claimed once, by one process: a restarted rank never applies it again
                os.close(os.open(path[:-5] + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            self.apply(fault, path[:-5] + ".taken")

    @staticmethod
    def took_effect(marker: str) -> None:
        """Tell the injector when the fault began (a stall: when the write blocks)."""
        with open(marker + ".tmp", "w") as f:
            json.dump({"t": time.time(), "pid": os.getpid()}, f)
        os.replace(marker + ".tmp", marker)

    def apply(self, fault: dict, marker: str) -> None:
        kind = fault["kind"]
        if kind == "hang":
            self.took_effect(marker)
            while True:  # a hang with a live, busy interpreter: no exception, no exit
                pass
        if kind == "slow":
            self.took_effect(marker)
            self.slow_until = time.time() + float(fault["seconds"])
            self.slow_factor = float(fault.get("factor", 1.5))
        elif kind == "nan":
            self.took_effect(marker)
            self.nan = True
        elif kind == "stall":
            self.stall, self.stall_marker = float(fault["seconds"]), marker


class Snapshots:
    """Tier-0 snapshots through rankguard.client.snapshots (the client's holder protocol)."""

    def __init__(self, args, rank: int, world: int):
        from rankguard.client.snapshots import SnapshotClient

        peers = tuple(p for p in args.snapshot_peers.split(",") if p)
        self.every = args.snapshot_every
        self._sending = self._spare = None
        self.client = SnapshotClient(args.snapshot_holder, peers, "goodput", rank, world,
                                     int(os.environ.get("LOCAL_WORLD_SIZE", world)), keep=2)  # fmt: skip

    def save(self, step: int, state: dict) -> None:
        from rankguard.client.snapshots import serialize

        # a NaN state must never be what a restart resumes from (the store's rule too)
        if all(bool(torch.isfinite(t).all()) for t in state["model"].values()):
            # two buffers in turn: the client's save waits for the previous send first
            data = serialize(state, reuse=self._spare)
            self.client.save(step, data)
            self._spare, self._sending = self._sending, data

    def resume(self) -> tuple[int, dict | None]:
        """The newest step every rank fetched intact (a collective), or (0, None)."""
        from rankguard.client.snapshots import common_steps, deserialize

        cands = self.client.candidates()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(cands))
        for step in common_steps(gathered)[:3]:
            got = self.client.fetch(step, cands[step])
            state = deserialize(got[0]) if got else None
            ok = torch.tensor([0 if state is None else 1])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if int(ok):
                return step, state
        return 0, None


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ft = None
    if RankMonitorClient is not None and os.environ.get("FT_LAUNCHER_IPC_SOCKET"):
        ft = RankMonitorClient()
        ft.init_workload_monitoring()
    # open for the process's life; line-buffered, so a killed rank loses no finished line
    log = open(args.progress, "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def emit(**event) -> None:
        if log is not None:
            log.write(json.dumps({"t": time.time(), "pid": os.getpid(), **event}) + "\n")

    emit(event="start", restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    torch.manual_seed(args.seed)
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, 4 * args.width), nn.GELU(), nn.Linear(4 * args.width, args.width)]  # fmt: skip
    model = DDP(nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rg = Reporter(model)
    store = CheckpointStore(args.ckpt_dir, keep=args.keep, reporter=rg if rank == 0 else None)
    snaps = Snapshots(args, rank, world) if args.snapshot_holder else None

    # resume: the newest of the disk checkpoint and the in-memory snapshot
    step, state = store.resume(weights_only=False)
    source = "disk" if state is not None else "scratch"
    if snaps is not None:
        s_step, s_state = snaps.resume()
        if s_step > step:
            step, state, source = s_step, s_state, "snapshot"
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    emit(event="resume", step=step, source=source)
    faults = Faults(args.faults, rank)
    while step < args.steps:
        step += 1
        faults.poll()
        t0 = time.perf_counter()
        s = rg.step(step, tokens=args.batch)
        # the batch is a function of (seed, step, rank): a redone step sees the same data
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 97 + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        s.phase("compute")
        loss = nn.functional.mse_loss(model(x), x.flip(1))
        if faults.nan:
            faults.nan = False
            loss = loss * float("nan")
        loss.backward()
        s.phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        s.loss(loss)
        s.end()
        if time.time() < faults.slow_until:  # this rank runs FACTOR x slower
            time.sleep((faults.slow_factor - 1.0) * (time.perf_counter() - t0))
        if ft is not None:
            ft.send_heartbeat()
        value = float(loss.detach())
        emit(event="step", step=step, loss=value if math.isfinite(value) else str(value))
        due = step % args.ckpt_every == 0 or step == args.steps
        if snaps is not None and step % snaps.every == 0:
            snaps.save(step, {"model": model.module.state_dict(), "opt": opt.state_dict()})
        if due and rank == 0:
            if faults.stall:
                faults.took_effect(faults.stall_marker)
                with rg.phase("checkpoint_save"):  # the write blocks, as on a stuck filesystem
                    time.sleep(faults.stall)
                faults.stall = 0.0
            store.save(step, {"model": model.module.state_dict(), "opt": opt.state_dict()})
    emit(event="done", step=step)
    if snaps is not None:
        snaps.client.close()
    rg.close()
    if ft is not None:
        ft.shutdown_workload_monitoring()
    # a rank tearing gloo down alone, its peer still connected, can abort at exit (std::terminate)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
