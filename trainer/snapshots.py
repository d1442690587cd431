"""Tier 0 in the trainer: snapshots into the node's holder, and the resume across tiers.

Save (every `--snapshot-every` steps, after the optimizer step): a flat copy of this rank's
model, optimizer and trainer state into a buffer (training waits for this copy only), then
the client sends it in the background (client/snapshots.py). Under DDP every rank of a node
holds the same model and optimizer state, so each copies only its part of it
(`split_replicated`, by local rank, balanced by bytes) with its own trainer state: a node
copies, sends and keeps one state per snapshot instead of one per rank.

Resume (every start; a collective): each rank lists every rank's snapshots on the holders
it can reach (local holder, its peer, --snapshot-peers); the ranks all-gather what they
saw with rank 0's newest committed disk step, and try the steps whose saved ranks are all
present somewhere, newest first. Each rank loads its own saved rank's copy, or at another
world size (a node lost) saved rank `rank % saved_world` (`source_rank`: under DDP every
rank holds the same state), which may exist only as the lost node's replica on its peer.
A part-wise snapshot is put back together from the parts its node's ranks saved
(`merge_replicated`), each fetched and verified like the rank's own.
A step is taken only when every rank fetched a copy whose checksum verifies and that
deserializes (all-reduce); otherwise the next older one. The disk tier is consulted as
soon as its newest committed checkpoint is newer than the snapshot step in hand, and wins
when its newest validated one is newer; at equal steps tier 0 wins (same state, faster to
load). FSDP2 (`sharded`): each rank's local shards, rebuilt as DTensors at load; same
world size only.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..client import checkpoint_store as store
from ..client.snapshots import (
    SnapshotClient,
    alias_key,
    deserialize,
    serialize,
    source_rank,
    usable_steps,
)
from ..contract.snapshots import read_token
from .config import SnapshotConfig
from .distributed import DistInfo, unwrap

log = logging.getLogger("rankguard.trainer.snapshots")


def _as_dtensor(local, like):
    """`local` (a shard as saved) as a DTensor laid out like `like` (the live parameter)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor) or isinstance(local, DTensor):
        return local
    return DTensor.from_local(local.to(like.device), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())  # fmt: skip


def reshard_state(payload: dict, model, optim) -> dict:
    """FSDP2: a snapshot holds each rank's local shards as plain tensors; rebuild the
    DTensors against the live model (same world size and layout: shards are per rank).
    DDP states pass through unchanged."""
    template = unwrap(model).state_dict()
    payload["model"] = {k: _as_dtensor(v, template.get(k)) for k, v in payload["model"].items()}
    params = [p for group in optim.param_groups for p in group["params"]]
    for index, state in payload["optim"].get("state", {}).items():
        p = params[index] if isinstance(index, int) and index < len(params) else None
        for key, v in list(state.items()):
            if key != "step" and p is not None and isinstance(v, torch.Tensor) and v.dim():
                state[key] = _as_dtensor(v, p)
    return payload


def newest_committed_step(root) -> int | None:
    """The newest committed (not necessarily valid) step dir: a cheap upper bound of what
    the disk tier can offer, read without hashing anything."""
    if root is None:
        return None
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = [p[0] for p in map(store.parse_step_dir_name, names) if p is not None and not p[1]]
    return max(steps, default=None)


def part_owners(sizes: list[int], parts: int) -> list[int]:
    """Which of `parts` ranks copies each item: the largest first, each to the least loaded
    so far (ties to the lowest index). Pure, so every rank of a node draws the same plan."""
    load = [0] * parts
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda p: (load[p], p))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(map(_nbytes, value.values()))
    return 0


def split_replicated(model_sd, optim_sd: dict, index: int, parts: int) -> tuple[dict, dict]:
    """Part `index` of `parts` of a model and optimizer state that every rank of the node
    holds alike (DDP): each weight and each parameter's optimizer state goes to one part,
    balanced by bytes. Tied weights (views of the same memory) go to the same part, where
    the snapshot stores them once. The optimizer's param groups (small) are in every part."""
    tied: dict[tuple, list[str]] = {}  # the weights' names, by the memory they view
    for k, v in model_sd.items():
        tied.setdefault(alias_key(v) if isinstance(v, torch.Tensor) else ("name", k), []).append(k)
    groups, params = list(tied.values()), list(optim_sd["state"])
    sizes = [_nbytes(model_sd[g[0]]) for g in groups]
    sizes += [_nbytes(optim_sd["state"][p]) for p in params]
    owners = part_owners(sizes, parts)
    owned = {k for g, o in zip(groups, owners[: len(groups)], strict=True) if o == index for k in g}
    model = collections.OrderedDict((k, v) for k, v in model_sd.items() if k in owned)
    if hasattr(model_sd, "_metadata"):  # module versions, which load_state_dict reads
        model._metadata = model_sd._metadata
    mine = owners[len(groups) :]
    state = {
        p: optim_sd["state"][p] for p, owner in zip(params, mine, strict=True) if owner == index
    }
    return model, {**optim_sd, "state": state}


def merge_replicated(parts: list[dict]) -> dict:
    """The whole state from all parts of one node's snapshot: model and optimizer state of
    all, the trainer state of the first (the saved rank the caller loads)."""
    model = collections.OrderedDict()
    if hasattr(parts[0]["model"], "_metadata"):
        model._metadata = parts[0]["model"]._metadata
    state: dict = {}
    for part in parts:
        model.update(part["model"])
        state.update(part["optim"]["state"])
    return {**parts[0], "model": model, "optim": {**parts[0]["optim"], "state": state}}


class TierZero:
    def __init__(self, cfg: SnapshotConfig, info: DistInfo, job: str, sharded: bool = False):
        self.cfg, self.info = cfg, info
        self.sharded = sharded  # FSDP: shards are per rank, so only the same world size
        # DDP: every rank of the node holds the same model and optimizer state, so each
        # snapshots a 1/local_world part of it (and its own trainer state)
        self.split = not sharded and info.local_world_size > 1
        token = read_token(cfg.token_file) if cfg.token_file else None
        self.client = SnapshotClient(cfg.holder, cfg.peers, job, info.rank, info.world_size,
                                     info.local_world_size, cfg.keep, token=token)  # fmt: skip
        self.saves = 0
        self.serialize_seconds = 0.0
        self.wait_seconds = 0.0  # for the previous send to end (one send in flight)
        # serialize seconds: of the first two saves (each fills a new buffer), and of the
        # last saves since (into the spare one)
        self._fresh: list[float] = []
        self._steady: collections.deque[float] = collections.deque(maxlen=1000)
        # two buffers in turn: one in the send in flight, the other (its send done) refilled
        self._sending: bytearray | memoryview | None = None
        self._spare: bytearray | memoryview | None = None

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and step % self.cfg.every == 0

    def save(self, step: int, model, optim, trainer_state: dict) -> float:
        """Copy this rank's state and hand it to the sender; returns the seconds blocked."""
        start = time.perf_counter()
        state = {"model": unwrap(model).state_dict(), "optim": optim.state_dict(),
                 "trainer": trainer_state}  # fmt: skip
        if self.split:
            index, parts = self.info.local_rank, self.info.local_world_size
            state["model"], state["optim"] = split_replicated(
                state["model"], state["optim"], index, parts
            )
            state["part"] = {"index": index, "of": parts}
        data = serialize(state, reuse=self._spare)
        took = time.perf_counter() - start
        self.serialize_seconds += took
        (self._fresh if len(self._fresh) < 2 else self._steady).append(took)
        self.wait_seconds += self.client.save(step, data)  # the send of `_sending` ends first
        self._spare, self._sending = self._sending, data
        self.saves += 1
        return time.perf_counter() - start

    def stats(self) -> dict:
        """Where the blocking went, for the summary: the copy (the first save's into a new
        buffer, and the median of the later ones into a spare) and the wait for the previous
        send."""
        return {
            "snapshot_saves": self.saves,
            "snapshot_serialize_seconds": self.serialize_seconds,
            "snapshot_wait_seconds": self.wait_seconds,
            "snapshot_first_serialize_seconds": self._fresh[0] if self._fresh else None,
            "snapshot_steady_serialize_seconds": (
                statistics.median(self._steady) if self._steady else None
            ),
            # a host_buffer view is page-locked (GPU states), a bytearray is not
            "snapshot_staging": {memoryview: "pinned", bytearray: "pageable"}.get(
                type(self._sending)
            ),
            "snapshot_send_failures": self.client.failures,
        }

    def close(self) -> None:
        self.client.close()

    def forget_after(self, step: int) -> None:
        """One rank per node drops the newer snapshots of this job from its holder."""
        if self.info.local_rank == 0:
            self.client.truncate(step)

    # -- resume -------------------------------------------------------------------
    def _fetch(self, step: int, rank: int, saved_world: int, inventory) -> tuple[dict, str] | None:
        """(payload, where from) of saved `rank`'s snapshot at `step`: the first copy that
        verifies and deserializes, or None."""
        sources = [(addr, kind, cs) for addr, s, r, w, kind, cs in inventory
                   if (s, r, w) == (step, rank, saved_world)]  # fmt: skip
        got = self.client.fetch(step, sources, rank=rank)
        if got is None:
            return None
        try:
            payload = deserialize(got[0])
            if not all(k in payload for k in ("model", "optim", "trainer")):
                raise ValueError("missing model, optim or trainer state")
        except Exception as exc:  # a snapshot that verifies but cannot load: refused
            log.warning("snapshot step %d rank %d refused: %r", step, rank, exc)
            return None
        return payload, got[1]

    def _whole(self, step: int, src: int, saved_world: int, inventory) -> tuple[dict, str] | None:
        """Saved rank `src`'s state at `step`, its model and optimizer state put together
        from the parts its node's ranks saved (each checked to be the part it claims)."""
        got = self._fetch(step, src, saved_world, inventory)
        part = got[0].get("part") if got else None
        if part is None:
            return got
        index, parts = (part.get("index"), part.get("of")) if isinstance(part, dict) else (0, 0)
        first = src - index if isinstance(index, int) else -1
        if not (
            isinstance(parts, int) and 0 <= index < parts and 0 <= first <= saved_world - parts
        ):
            log.warning("snapshot step %d rank %d refused: bad part %.100r", step, src, part)
            return None
        pieces = [got[0]]
        for j in range(parts):
            if j == index:
                continue
            other = self._fetch(step, first + j, saved_world, inventory)
            if other is None or other[0].get("part") != {"index": j, "of": parts}:
                log.warning("snapshot step %d: part %d of rank %d's state missing", step, j, src)
                return None
            pieces.append(other[0])
        return merge_replicated(pieces), got[1]

    def _try(self, step: int, saved_world: int, inventory, model, optim) -> tuple[dict, str] | None:
        src = source_rank(self.info.rank, self.info.world_size, saved_world)
        got = self._whole(step, src, saved_world, inventory)
        payload = got[0] if got else None
        if payload is not None and self.sharded:
            try:
                payload = reshard_state(payload, model, optim)
            except Exception as exc:  # a shard that does not fit this layout: refused
                log.warning("snapshot step %d rank %d refused: %r", step, src, exc)
                payload = None
        flag = torch.tensor([1 if payload is not None else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            if self.info.rank == 0:
                log.warning("snapshot step %d not usable on every rank: next best state", step)
            return None
        unwrap(model).load_state_dict(payload["model"])
        optim.load_state_dict(payload["optim"])
        state = payload["trainer"]
        state["same_world"] = saved_world == self.info.world_size  # else: RNG reseeded
        return state, got[1] if src == self.info.rank else f"{got[1]} (rank {src})"

    def resume(self, model, optim, ckpt) -> tuple[dict | None, str | None]:
        """(trainer state, source) of the newest validated state across tiers, loaded into
        model and optimizer on every rank; (None, None) when there is none."""
        inventory = self.client.inventory()
        view: dict[int, dict[int, list[int]]] = {}
        for _, step, rank, world, _, _ in inventory:
            view.setdefault(step, {}).setdefault(world, []).append(rank)
        disk_top = newest_committed_step(ckpt.root) if ckpt and self.info.rank == 0 else None
        gathered: list = [None] * self.info.world_size
        dist.all_gather_object(gathered, (view, disk_top))
        disk_top = gathered[0][1]
        consulted, disk_valid = False, None
        for step, saved_world in usable_steps([g[0] for g in gathered], self.info.world_size):
            if self.sharded and saved_world != self.info.world_size:
                continue  # FSDP shards of another world size: the disk tier reshards
            if ckpt and not consulted and disk_top is not None and step < disk_top:
                consulted = True  # the disk may have something newer: ask it first
                state = ckpt.resume(model, optim, newer_than=step)
                if state is not None:
                    return state, "disk"
                disk_valid = ckpt.newest_validated
            if consulted and disk_valid is not None and step < disk_valid:
                break  # the disk's validated checkpoint is newer than what is left here
            got = self._try(step, saved_world, inventory, model, optim)
            if got is not None:
                return got
        if ckpt:
            state = ckpt.resume(model, optim)
            if state is not None:
                return state, "disk"
        return None, None
