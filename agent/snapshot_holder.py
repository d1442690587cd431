"""The per-node snapshot holder: tier-0 checkpoints in memory that outlives the ranks.

A small process of its own (`rankguard snapshot-holder run`), not a thread of the agent:
its memory must survive any rank and is unrelated to the agent's restarts, and a holder
can be started beside a job without changing the agent. Ranks send their snapshot bytes
over a unix socket (`contract/snapshots.py`); the holder keeps them in its own heap and
forwards every local snapshot to its peer holder (the next node in the ring; on one
machine a second holder), which keeps it as a replica. It never imports torch.

`SnapshotStore` is the pure part (what is held, what is evicted); `HolderServer` is the I/O.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field

from ..contract import snapshots as wire

log = logging.getLogger("rankguard.snapshot_holder")

LOCAL, REPLICA = "local", "replica"


@dataclass
class Held:
    job: str
    step: int
    rank: int
    world: int
    local_world: int  # ranks of the sending node: a step is complete here when all arrived
    checksum: str
    data: bytes | bytearray
    kind: str = LOCAL
    received_at: float = field(default_factory=time.time)


class SnapshotStore:
    """Snapshots by (job, kind) -> step -> rank. Bounded per (job, kind): the newest `keep`
    steps plus the newest complete step (so a half-received step never pushes out the last
    usable one): at most keep + 1 steps. Thread-safe."""

    def __init__(self, max_keep: int = 8):
        self.max_keep = max_keep
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], dict[int, dict[int, Held]]] = {}
        self._keep: dict[str, int] = {}
        self.evicted = 0

    def put(self, h: Held, keep: int) -> list[int]:
        """Store (replacing the same job/kind/step/rank); returns the steps evicted."""
        keep = max(1, min(keep, self.max_keep))
        with self._lock:
            self._keep[h.job] = keep
            steps = self._held.setdefault((h.job, h.kind), {})
            steps.setdefault(h.step, {})[h.rank] = h
            return self._evict(steps, keep)

    def _evict(self, steps: dict[int, dict[int, Held]], keep: int) -> list[int]:
        ordered = sorted(steps, reverse=True)
        complete = [s for s in ordered if _complete(steps[s])]
        retain = set(ordered[:keep]) | set(complete[:1])
        gone = [s for s in ordered if s not in retain]
        for s in gone:
            del steps[s]
        self.evicted += len(gone)
        return gone

    def listing(self, job: str, rank: int, world: int) -> list[dict]:
        """What this holder has for one rank: step, checksum, kind, newest first."""
        out = []
        with self._lock:
            for kind in (LOCAL, REPLICA):
                for step, ranks in self._held.get((job, kind), {}).items():
                    h = ranks.get(rank)
                    if h is not None and h.world == world:
                        out.append({"step": step, "checksum": h.checksum, "kind": kind,
                                    "bytes": len(h.data)})  # fmt: skip
        return sorted(out, key=lambda e: (-e["step"], e["kind"]))

    def get(self, job: str, step: int, rank: int, kind: str | None = None) -> Held | None:
        with self._lock:
            for k in (kind,) if kind else (LOCAL, REPLICA):
                h = self._held.get((job, k), {}).get(step, {}).get(rank)
                if h is not None:
                    return h
        return None

    def truncate(self, job: str, after: int) -> int:
        """Drop every step newer than `after` (a job resumed from an older state: its later
        snapshots belong to a past that will not happen); returns how many."""
        dropped = 0
        with self._lock:
            for kind in (LOCAL, REPLICA):
                steps = self._held.get((job, kind), {})
                for s in [s for s in steps if s > after]:
                    del steps[s]
                    dropped += 1
        return dropped

    def corrupt(self, job: str, step: int, rank: int, kind: str) -> bool:
        """Fault injection: flip one byte of a held snapshot (a new buffer: a replica queued
        for sending keeps the bytes it had)."""
        with self._lock:
            h = self._held.get((job, kind), {}).get(step, {}).get(rank)
            if h is None or not h.data:
                return False
            data = bytearray(h.data)
            data[len(data) // 2] ^= 0xFF
            h.data = data
            return True

    def status(self) -> dict:
        with self._lock:
            jobs = []
            total = 0
            for (job, kind), steps in sorted(self._held.items()):
                for step in sorted(steps):
                    ranks = steps[step]
                    size = sum(len(h.data) for h in ranks.values())
                    total += size
                    jobs.append({"job": job, "kind": kind, "step": step,
                                 "ranks": sorted(ranks), "complete": _complete(ranks),
                                 "bytes": size})  # fmt: skip
            return {"bytes": total, "snapshots": jobs, "keep": dict(self._keep),
                    "max_keep": self.max_keep, "evicted": self.evicted}  # fmt: skip


def _complete(ranks: dict[int, Held]) -> bool:
    any_one = next(iter(ranks.values()), None)
    return any_one is not None and len(ranks) >= any_one.local_world


class Replicator(threading.Thread):
    """Forwards local snapshots (and truncations) to the peer holder, in order, on one
    connection. A slow or absent peer never blocks the ranks: the queue is bounded and the
    oldest waiting snapshot is dropped (counted) to make room."""

    def __init__(self, peer: str, depth: int = 16):
        super().__init__(name="rankguard-replicator", daemon=True)
        self.peer = peer
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self.depth = depth
        self.sent = 0
        self.dropped = 0
        self.failures = 0
        self.last_error: str | None = None
        self._sock: socket.socket | None = None

    def submit(self, header: dict, data=b"") -> None:
        with self._cv:
            if len(self._q) >= self.depth:
                self._q.popleft()
                self.dropped += 1
            self._q.append((header, data))
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._q)

    def run(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                header, data = self._q[0]
            try:
                if self._sock is None:
                    self._sock = wire.connect(self.peer)
                wire.send_frame(self._sock, header, data)
                answer, _ = wire.recv_frame(self._sock)
                if not answer.get("ok"):
                    raise wire.WireError(str(answer.get("error")))
                self.sent += header["op"] == "put"
                with self._cv:
                    if self._q and self._q[0][0] is header:
                        self._q.popleft()
            except (OSError, EOFError, wire.WireError) as exc:
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                with self._cv:  # this one is not retried forever: the next is newer
                    if self._q and self._q[0][0] is header:
                        self._q.popleft()
                        self.dropped += 1
                time.sleep(0.2)

    def status(self) -> dict:
        return {"peer": self.peer, "sent": self.sent, "dropped": self.dropped,
                "failures": self.failures, "pending": self.pending(),
                "last_error": self.last_error}  # fmt: skip


def _str(h: dict, name: str) -> str:
    v = h.get(name)
    if not isinstance(v, str) or not v or len(v) > 256:
        raise wire.WireError(f"{name}: expected a non-empty string")
    return v


def _int(h: dict, name: str, low: int = 0) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise wire.WireError(f"{name}: expected an integer >= {low}")
    return v


class HolderServer:
    """Serves the store on a unix socket and optionally on TCP (for peers on other nodes)."""

    def __init__(self, socket_path: str | None, bind: tuple[str, int] | None = None,
                 peer: str | None = None, max_keep: int = 8):  # fmt: skip
        self.store = SnapshotStore(max_keep)
        self.replicator = Replicator(peer) if peer else None
        self.started = time.time()
        self.requests = collections.Counter()
        self.refused = collections.Counter()
        self._servers: list[socketserver.BaseServer] = []
        handler = self._handler()
        if socket_path:
            if os.path.exists(socket_path):
                os.unlink(socket_path)  # a stale socket of a dead holder
            old = os.umask(0o177)  # only this user's ranks may talk to it
            try:
                self._servers.append(_UnixServer(socket_path, handler))
            finally:
                os.umask(old)
        if bind:
            self._servers.append(_TCPServer(bind, handler))
        if not self._servers:
            raise ValueError("a snapshot holder needs a socket path or a TCP address")

    @property
    def tcp_port(self) -> int | None:
        for s in self._servers:
            if isinstance(s, _TCPServer):
                return s.server_address[1]
        return None

    def _handler(self):
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                sock.settimeout(300)
                while True:
                    try:
                        header, data = wire.recv_frame(sock)
                    except (EOFError, OSError):
                        return
                    except wire.WireError as exc:
                        server.refused["malformed"] += 1
                        wire.send_frame(sock, {"ok": False, "error": str(exc)})
                        return
                    try:
                        answer, payload = server.dispatch(header, data)
                    except wire.WireError as exc:
                        server.refused[str(header.get("op"))] += 1
                        answer, payload = {"ok": False, "error": str(exc)}, b""
                    try:
                        wire.send_frame(sock, answer, payload)
                    except OSError:
                        return

        return Handler

    def dispatch(self, h: dict, data: bytearray) -> tuple[dict, bytes]:
        op = h.get("op")
        self.requests[str(op)[:32]] += 1
        if op == "put":
            held = Held(job=_str(h, "job"), step=_int(h, "step"), rank=_int(h, "rank"),
                        world=_int(h, "world", 1), local_world=_int(h, "local_world", 1),
                        checksum=_str(h, "checksum"), data=bytes(data),
                        kind=REPLICA if h.get("replica") else LOCAL)  # fmt: skip
            keep = _int(h, "keep", 1)
            evicted = self.store.put(held, keep)
            if self.replicator and held.kind == LOCAL:
                fwd = {k: v for k, v in h.items() if k != "size"}
                self.replicator.submit({**fwd, "replica": True}, held.data)
            return {"ok": True, "evicted": evicted}, b""
        if op == "list":
            return {"ok": True, "snapshots": self.store.listing(
                _str(h, "job"), _int(h, "rank"), _int(h, "world", 1))}, b""  # fmt: skip
        if op == "get":
            held = self.store.get(_str(h, "job"), _int(h, "step"), _int(h, "rank"), h.get("kind"))
            if held is None:
                raise wire.WireError("no such snapshot")
            return {"ok": True, "checksum": held.checksum, "kind": held.kind}, held.data
        if op == "truncate":
            job, after = _str(h, "job"), _int(h, "after")
            dropped = self.store.truncate(job, after)
            if self.replicator and not h.get("replica"):
                self.replicator.submit({"op": "truncate", "job": job, "after": after,
                                        "replica": True})  # fmt: skip
            return {"ok": True, "dropped": dropped}, b""
        if op == "corrupt":
            kind = h.get("kind", LOCAL)
            if kind not in (LOCAL, REPLICA):
                raise wire.WireError("kind: local or replica")
            if not self.store.corrupt(_str(h, "job"), _int(h, "step"), _int(h, "rank"), kind):
                raise wire.WireError("no such snapshot")
            return {"ok": True}, b""
        if op == "status":
            return {"ok": True, **self.status()}, b""
        raise wire.WireError(f"unknown op {op!r}")

    def status(self) -> dict:
        return {
            "pid": os.getpid(),
            "uptime_seconds": round(time.time() - self.started, 1),
            **self.store.status(),
            "replication": self.replicator.status() if self.replicator else None,
            "requests": dict(self.requests),
            "refused": dict(self.refused),
        }

    def serve_forever(self) -> None:
        if self.replicator:
            self.replicator.start()
        threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in self._servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def shutdown(self) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _TCPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
