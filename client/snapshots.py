"""Tier-0 snapshots, the rank's side: copy the state into the node's snapshot holder and
find it again after a restart (stdlib; torch imported lazily, only to (de)serialize).

Save: the rank serializes its state (`serialize`: the structure pickled, the tensors'
bytes copied back to back into one buffer, page-locked for a GPU's state; the only part
training waits for), then a background thread checksums it and sends it to the local
holder, which replicates it to its peer. At most one send in flight: a save
due while the previous is still sending waits for it.

Resume: `candidates()` lists the steps this rank can fetch from the local holder and the
other holders it knows (its peers), with their checksums; the caller agrees with the other
ranks on a step every rank has (`common_steps`), then `fetch()` returns the bytes of the
first copy whose checksum verifies (local first, then peers), or None: a corrupt copy is
refused and the next one tried.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..contract import snapshots as wire
from .checkpoint_store import DataUnpickler

log = logging.getLogger("rankguard.client.snapshots")


MAGIC = b"RGSNAP1\n"
_HEAD = struct.Struct(">Q")


class _Pickler(pickle.Pickler):
    """Pickles the structure; every tensor becomes a reference into the flat payload. Tensors
    that are views of the same memory (tied weights: an embedding and the output layer) are
    stored once, and each name refers to that copy (GPT-2's 124M model: 154 MB less)."""

    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.tensors: list = []
        self.offset = 0
        self._refs: dict[tuple, tuple] = {}

    def persistent_id(self, obj):
        import torch

        if not isinstance(obj, torch.Tensor):
            return None
        t = obj.detach()
        if _is_dtensor(t):  # FSDP2: this rank's shard (rebuilt against the model at load)
            t = t.to_local()
        key = alias_key(t)
        if key in self._refs:
            return self._refs[key]
        nbytes = t.numel() * t.element_size()
        self.tensors.append((t, self.offset, nbytes))
        ref = ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), self.offset)
        self._refs[key] = ref
        self.offset += nbytes
        return ref


def alias_key(t) -> tuple:
    """Equal for two tensors exactly when they are the same view of the same memory."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(t, DTensor)


class _Unpickler(DataUnpickler):
    """Rebuilds the structure from the payload. Data only, never code, as a checkpoint
    read with weights_only=True: the tensor references below, and no global but
    DataUnpickler's."""

    def __init__(self, file, payload: memoryview):
        super().__init__(file)
        self.payload = payload

    def persistent_load(self, pid):
        import torch

        kind, dtype_name, shape, offset = pid
        dtype = getattr(torch, dtype_name, None)
        if kind != "tensor" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"bad tensor reference {pid!r}")
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self.payload, dtype=dtype, count=numel, offset=offset)
        return flat.reshape(shape).clone()


def serialize(state, reuse: bytearray | memoryview | None = None) -> bytearray | memoryview:
    """A flat copy of a state (nested dicts/lists of tensors and plain values): a small
    pickle of the structure, then every tensor's bytes back to back. Ten times faster than
    torch.save into a buffer on the tiny model (docs/architecture.md).

    A state on the GPU is copied into page-locked host memory (`host_buffer`, a memoryview)
    with asynchronous copies and one wait per device: a device-to-host copy into pageable
    memory goes through the driver's bounce buffer at a fraction of the speed, so the
    copy itself is the floor of what training waits for (issue 14). A CPU state goes into a
    bytearray.

    `reuse`: a buffer from an earlier call that nothing reads any more (its send is done),
    filled in place when its size and kind match: a new buffer of a large state is
    zero-filled (or page-locked) and page-faulted in first, which cost more than the copy
    itself (issue 14)."""
    import torch

    head = io.BytesIO()
    pickler = _Pickler(head)
    pickler.dump(state)
    structure = head.getvalue()
    start = len(MAGIC) + _HEAD.size + len(structure)
    size = start + pickler.offset
    devices = {t.device for t, _, _ in pickler.tensors if t.is_cuda}
    out = None
    if _pinned_staging(devices):
        out = reuse if _staging_of(reuse) is not None and len(reuse) == size else _pinned(size)
    if out is None:  # a CPU state, or no page-locked memory to be had
        out = reuse if isinstance(reuse, bytearray) and len(reuse) == size else bytearray(size)
    staging = _staging_of(out)
    if staging is None:
        staging = torch.frombuffer(out, dtype=torch.uint8)
    out[:start] = MAGIC + _HEAD.pack(len(structure)) + structure
    for t, offset, nbytes in pickler.tensors:
        if nbytes:
            dst = staging[start + offset : start + offset + nbytes]
            dst.copy_(t.contiguous().reshape(-1).view(torch.uint8), non_blocking=bool(devices))
    for device in devices:  # the copies were queued on each device's current stream
        torch.cuda.current_stream(device).synchronize()
    return out


def _pinned_staging(devices: set) -> bool:
    """Whether to stage in page-locked memory: the state has CUDA tensors. (The tests
    replace it to run the GPU path's buffer handling on a machine without one.)"""
    return bool(devices)


def host_buffer(size: int, pinned: bool = True) -> memoryview:
    """`size` bytes of host memory as a writable memoryview over a torch uint8 tensor,
    page-locked by default (torch's pinned allocator; it rounds a block up to a power of
    two, so a 1.4 GiB state takes 2 GiB of locked memory per buffer). The view keeps the
    tensor alive: its buffer is a ctypes array that holds the tensor as an attribute."""
    import ctypes

    import torch

    staging = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    array = (ctypes.c_ubyte * size).from_address(staging.data_ptr())
    array.staging = staging
    return memoryview(array).cast("B")


_pinning_failed = False


def _pinned(size: int) -> memoryview | None:
    """A new page-locked buffer, or None where the allocation fails (locked memory is
    scarcer than memory: a snapshot then takes the slower pageable copy, never the run);
    after one failure, not tried again in this process."""
    global _pinning_failed
    if _pinning_failed:
        return None
    try:
        return host_buffer(size)
    except RuntimeError as exc:
        _pinning_failed = True
        log.warning("snapshots staged in pageable memory (slower copies): %s", exc)
        return None


def _staging_of(buf):
    """The tensor behind a `host_buffer` view; None for anything else."""
    return getattr(buf.obj, "staging", None) if isinstance(buf, memoryview) else None


def deserialize(data) -> dict:
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a rankguard snapshot")
    (n,) = _HEAD.unpack(view[len(MAGIC) : len(MAGIC) + _HEAD.size])
    start = len(MAGIC) + _HEAD.size + n
    if start > len(view):
        raise ValueError("truncated snapshot")
    return _Unpickler(io.BytesIO(view[len(MAGIC) + _HEAD.size : start]), view[start:]).load()


def usable_steps(views: list[dict], world: int) -> list[tuple[int, int]]:
    """(step, saved world size) of every snapshot step whose ranks are all listed by some
    holder that some rank can reach, newest first. `views` holds each rank's view,
    {step: {world: [ranks]}}; their union decides (a lost node's ranks survive only as
    replicas, which some ranks cannot reach). At a step saved at several world sizes the
    current one is preferred. Pure: every rank computes the same plan from the same views."""
    union: dict[int, dict[int, set[int]]] = {}
    for view in views:
        for step, worlds in view.items():
            for w, ranks in worlds.items():
                union.setdefault(int(step), {}).setdefault(int(w), set()).update(ranks)
    out = []
    for step in sorted(union, reverse=True):
        complete = [w for w, ranks in union[step].items() if ranks >= set(range(w))]
        if complete:
            out.append((step, world if world in complete else max(complete)))
    return out


def source_rank(rank: int, world: int, saved_world: int) -> int:
    """The saved rank whose snapshot `rank` loads. The same world: its own. Another world
    (nodes lost or added): rank r takes saved rank r mod saved_world; under DDP every rank
    holds the same model and optimizer state, so any copy is the state of that step."""
    return rank if world == saved_world else rank % saved_world


def common_steps(per_rank: list[list[int]]) -> list[int]:
    """Steps every rank can fetch, newest first: a snapshot is usable only when all ranks
    of its step are present."""
    if not per_rank:
        return []
    common = set(per_rank[0])
    for steps in per_rank[1:]:
        common &= set(steps)
    return sorted(common, reverse=True)


class SnapshotClient:
    def __init__(self, local: str, peers: tuple[str, ...], job: str, rank: int, world: int,
                 local_world: int, keep: int, timeout: float = 30.0,
                 token: str | None = None):  # fmt: skip
        self.local, self.job, self.rank, self.world = local, job, rank, world
        self.local_world, self.keep, self.timeout = local_world, keep, timeout
        self.token = token  # for holders on TCP (a lost node's replica on another node)
        self.peers = [p for p in peers if p != local]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankguard-snap")
        self._inflight: Future | None = None
        self._sock = None
        self._lock = threading.Lock()
        self.sent = 0
        self.failures = 0
        self.last_error: str | None = None
        self.bytes = 0

    # -- save -----------------------------------------------------------------------
    def save(self, step: int, data: bytes) -> float:
        """Hand `data` (this rank's state at `step`) to the sender; returns the seconds
        spent waiting for the previous send."""
        start = time.perf_counter()
        self.wait()
        self._inflight = self._executor.submit(self._send, step, data)
        return time.perf_counter() - start

    def _send(self, step: int, data: bytes) -> None:
        header = {"op": "put", "job": self.job, "step": step, "rank": self.rank,
                  "world": self.world, "local_world": self.local_world, "keep": self.keep,
                  "checksum": wire.checksum(data)}  # fmt: skip
        for attempt in (1, 2):  # a holder restarted since the last send: reconnect once
            try:
                with self._lock:
                    if self._sock is None:
                        self._sock = wire.connect(self.local, self.timeout, self.token)
                    wire.send_frame(self._sock, header, data)
                    answer, _ = wire.recv_frame(self._sock)
                if not answer.get("ok"):
                    raise wire.WireError(str(answer.get("error")))
                self.sent += 1
                self.bytes = len(data)
                return
            except (OSError, EOFError, wire.WireError) as exc:
                self._close_socket()
                if attempt == 2 or isinstance(exc, wire.WireError):
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("snapshot of step %d not held: %s", step, self.last_error)
                    return

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None

    def _close_socket(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        self._close_socket()

    # -- resume ---------------------------------------------------------------------
    def holders(self) -> list[str]:
        """The local holder, its peer (from its status) and the configured peers."""
        found = [self.local]
        try:
            status, _ = wire.request(self.local, {"op": "status"}, timeout=self.timeout,
                                     token=self.token)  # fmt: skip
            peer = (status.get("replication") or {}).get("peer")
            if isinstance(peer, str) and peer:
                found.append(peer)
        except (OSError, EOFError, ValueError, wire.WireError):
            pass  # the local holder is gone (a lost node): the peers may have a replica
        return list(dict.fromkeys(found + self.peers))

    def candidates(self) -> dict[int, list[tuple[str, str, str]]]:
        """step -> [(holder, kind, checksum)] this rank could fetch, local copies first."""
        out: dict[int, list[tuple[str, str, str]]] = {}
        for addr in self.holders():
            try:
                answer, _ = wire.request(addr, {"op": "list", "job": self.job, "rank": self.rank,
                                                "world": self.world}, timeout=self.timeout,
                                         token=self.token)  # fmt: skip
            except (OSError, EOFError, ValueError, wire.WireError) as exc:
                log.info("snapshot holder %s not usable: %s", addr, exc)
                continue
            for e in answer.get("snapshots", []):
                if isinstance(e, dict) and isinstance(e.get("step"), int):
                    out.setdefault(e["step"], []).append((addr, e.get("kind"), e.get("checksum")))
        for sources in out.values():
            sources.sort(key=lambda s: s[1] != "local")
        return out

    def inventory(self) -> list[tuple[str, int, int, int, str, str]]:
        """Every rank's snapshots of this job on every holder this rank can reach, as
        (holder, step, rank, world, kind, checksum); this node's own copies first."""
        out = []
        for addr in self.holders():
            try:
                answer, _ = wire.request(addr, {"op": "list", "job": self.job, "all_ranks": True},
                                         timeout=self.timeout, token=self.token)  # fmt: skip
            except (OSError, EOFError, ValueError, wire.WireError) as exc:
                log.info("snapshot holder %s not usable: %s", addr, exc)
                continue
            for e in answer.get("snapshots", []):
                try:
                    out.append((addr, wire._int(e, "step"), wire._int(e, "rank"),
                                wire._int(e, "world", 1), e["kind"], wire._str(e, "checksum")))  # fmt: skip
                except (wire.WireError, KeyError, TypeError, AttributeError):
                    log.warning("snapshot holder %s: bad listing entry %.200r", addr, e)
        out.sort(key=lambda e: (e[0] != self.local, e[4] != "local"))
        return out

    def fetch(
        self, step: int, sources: list[tuple[str, str, str]], rank: int | None = None
    ) -> tuple[bytearray, str] | None:
        """The first copy of `rank`'s (this rank's by default) `step` whose bytes match the
        checksum it was saved with, and where it came from ('holder' for this node's own
        copy, else kind@holder); None if none does."""
        rank = self.rank if rank is None else rank
        for addr, kind, expected in sources:
            try:
                answer, data = wire.request(addr, {"op": "get", "job": self.job, "step": step,
                                                   "rank": rank, "kind": kind},
                                            timeout=self.timeout, token=self.token)  # fmt: skip
            except (OSError, EOFError, ValueError, wire.WireError) as exc:
                log.warning("snapshot step %d from %s: %s", step, addr, exc)
                continue
            if wire.checksum(data) != expected or answer.get("checksum") != expected:
                log.warning("snapshot step %d rank %d at %s (%s): checksum mismatch, refused",
                            step, rank, addr, kind)  # fmt: skip
                continue
            where = "holder" if addr == self.local and kind == "local" else f"{kind}@{addr}"
            return data, where
        return None

    def truncate(self, after: int) -> None:
        """Drop this job's snapshots newer than the state just resumed (local holder and, by
        its replication, the peer): they belong to a past that will not happen."""
        try:
            wire.request(self.local, {"op": "truncate", "job": self.job, "after": after},
                         timeout=self.timeout, token=self.token)  # fmt: skip
        except (OSError, EOFError, ValueError, wire.WireError) as exc:
            log.warning("snapshot holder %s: truncate failed: %s", self.local, exc)
