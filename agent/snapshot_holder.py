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
import contextlib
import logging
import os
import socket
import socketserver
import sys
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
    usable one): at most keep + 1 steps. Thread-safe.

    The buffers of dropped snapshots are kept as spares (at most two steps of the sending
    node's ranks: its local copies and a peer's replicas) and refilled by the next snapshot
    of about the same size: a new 130 MB buffer is zero-filled and faulted
    in page by page, 95-160 ms of a core here per snapshot received, beside training, while
    receiving into a used one costs the copy alone (session 12)."""

    def __init__(self, max_keep: int = 8):
        self.max_keep = max_keep
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], dict[int, dict[int, Held]]] = {}
        self._keep: dict[str, int] = {}
        self._spares: collections.deque[bytearray] = collections.deque()
        self.evicted = 0
        self.reused = 0  # receives into a spare buffer

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
            self._retire(steps.pop(s))
        self.evicted += len(gone)
        return gone

    def _retire(self, ranks: dict[int, Held]) -> None:
        """Keep as spares the buffers of a dropped step's snapshots that nothing else still
        references. A reader that took one before the drop (a `get` being answered, the
        replicator's queue, a send's memoryview) holds a reference of its own: then the
        buffer is left to it and freed when it is done (CPython's reference counts: with
        no reader, `held` and getrefcount's argument are the only ones)."""
        while ranks:
            held = ranks.popitem()[1]
            if (
                isinstance(held.data, bytearray)
                and sys.getrefcount(held) == 2
                and sys.getrefcount(held.data) == 2
            ):
                self._spares.append(held.data)
                if len(self._spares) > 2 * held.local_world:
                    self._spares.popleft()

    def spare(self, size: int) -> bytearray | None:
        """A used buffer resized to `size` bytes to receive a snapshot into, or None. Any
        spare within an eighth of the size will do: a rank's snapshots differ by a few
        bytes (its trainer state), and a large bytearray is resized in place (mremap)."""
        if size <= 0:
            return None
        with self._lock:
            for i, buf in enumerate(self._spares):
                if abs(len(buf) - size) <= size // 8:
                    del self._spares[i]
                    self.reused += 1
                    break
            else:
                return None
        if len(buf) > size:
            del buf[size:]
        else:
            buf.extend(bytes(size - len(buf)))
        return buf

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

    def listing_all(self, job: str) -> list[dict]:
        """Every rank's snapshots of a job, any world size (a resume at another world size
        loads another rank's state: under DDP every rank holds the same model)."""
        out = []
        with self._lock:
            for kind in (LOCAL, REPLICA):
                for step, ranks in self._held.get((job, kind), {}).items():
                    for rank, h in ranks.items():
                        out.append({"step": step, "rank": rank, "world": h.world, "kind": kind,
                                    "checksum": h.checksum, "bytes": len(h.data)})  # fmt: skip
        return sorted(out, key=lambda e: (-e["step"], e["rank"], e["kind"]))

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
                    self._retire(steps.pop(s))
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
            held = []
            for (job, kind), steps in sorted(self._held.items()):
                for step in sorted(steps):
                    ranks = steps[step]
                    held.append(wire.StepHeld(job, kind, step, tuple(sorted(ranks)),
                                              _complete(ranks),
                                              sum(len(h.data) for h in ranks.values())))  # fmt: skip
            return {"bytes": sum(s.bytes for s in held), "snapshots": tuple(held),
                    "keep": dict(self._keep), "max_keep": self.max_keep,
                    "evicted": self.evicted,
                    "spare_bytes": sum(len(b) for b in self._spares)}  # fmt: skip


def _complete(ranks: dict[int, Held]) -> bool:
    any_one = next(iter(ranks.values()), None)
    return any_one is not None and len(ranks) >= any_one.local_world


class Replicator(threading.Thread):
    """Forwards local snapshots (and truncations) to the peer holder, in order, on one
    connection. A slow or absent peer never blocks the ranks: the queue is bounded and the
    oldest waiting snapshot is dropped (counted) to make room. With several peers (the
    next nodes of the ring), a peer that fails is left for the next one: a lost node's
    successor keeps getting replicas."""

    def __init__(self, peers: list[str], depth: int = 16, token: str | None = None):
        super().__init__(name="rankguard-replicator", daemon=True)
        self.peers = list(peers)
        self.token = token
        self._current = 0
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self.depth = depth
        self.sent = 0
        self.dropped = 0
        self.failures = 0
        self.last_error: str | None = None
        self._sock: socket.socket | None = None

    @property
    def peer(self) -> str:
        return self.peers[self._current]

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
                    self._sock = wire.connect(self.peer, token=self.token)
                wire.send_frame(self._sock, header, data)
                answer, _ = wire.recv_frame(self._sock, max_payload=0)
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
                self._current = (self._current + 1) % len(self.peers)
                with self._cv:  # this one is not retried forever: the next is newer
                    if self._q and self._q[0][0] is header:
                        self._q.popleft()
                        self.dropped += 1
                time.sleep(0.2)
            header = data = None  # not kept while waiting: a spare is unreferenced

    def status(self) -> dict:
        return {"peer": self.peer, "sent": self.sent, "dropped": self.dropped,
                "failures": self.failures, "pending": self.pending(),
                "last_error": self.last_error}  # fmt: skip


DEFAULT_MAX_SNAPSHOT_BYTES = 16 * 1024**3
#: Between two requests of a local rank or an authenticated peer (a snapshot may be minutes
#: apart).
IDLE_SECONDS = 300
#: From a TCP connection to the end of its handshake: two small frames each way.
DEFAULT_HANDSHAKE_SECONDS = 5.0
#: TCP connections not yet authenticated from one peer address at once (a holder's peer
#: and a rank fetching a replica need one each).
DEFAULT_MAX_UNAUTHENTICATED = 4


class PeerSlots:
    """Unauthenticated connections by peer address, at most `limit` each at once: one
    takes a slot when accepted and gives it back once authenticated or closed. Anyone who
    can reach the port can open connections; this bounds what they hold. Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._peer_of: dict[socket.socket, str] = {}
        self._count: collections.Counter[str] = collections.Counter()

    def take(self, conn: socket.socket, peer: str) -> bool:
        with self._lock:
            if self._count[peer] >= self.limit:
                return False
            self._count[peer] += 1
            self._peer_of[conn] = peer
            return True

    def give_back(self, conn: socket.socket) -> None:
        """Idempotent: a connection gives its slot back at most once."""
        with self._lock:
            peer = self._peer_of.pop(conn, None)
            if peer is not None:
                self._count[peer] -= 1
                if not self._count[peer]:
                    del self._count[peer]

    def held(self) -> int:
        with self._lock:
            return len(self._peer_of)


class HolderServer:
    """Serves the store on a unix socket (owner-only) and optionally on TCP, for peers on
    other nodes; TCP needs the cluster's snapshot token (contract/snapshots.py). A TCP
    connection must finish its handshake within `handshake_seconds` and one peer address
    may hold `max_unauthenticated` connections that have not: more are closed on accept,
    both counted in `refused`. Authenticated and unix connections may idle IDLE_SECONDS."""

    def __init__(self, socket_path: str | None, bind: tuple[str, int] | None = None,
                 peer: str | list[str] | None = None, max_keep: int = 8,
                 token: str | None = None,
                 max_snapshot_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES,
                 handshake_seconds: float = DEFAULT_HANDSHAKE_SECONDS,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED):  # fmt: skip
        if bind and not token:
            raise ValueError("a holder on TCP needs a token (--token-file)")
        peers = [peer] if isinstance(peer, str) else list(peer or [])
        self.store = SnapshotStore(max_keep)
        self.token = token
        self.max_snapshot_bytes = max_snapshot_bytes
        self.handshake_seconds = handshake_seconds
        self.unauthenticated = PeerSlots(max_unauthenticated)
        self.replicator = Replicator(peers, token=token) if peers else None
        self.started = time.time()
        self.requests = collections.Counter()
        self.refused = collections.Counter()
        self._servers: list[socketserver.BaseServer] = []
        if socket_path:
            if os.path.exists(socket_path):
                os.unlink(socket_path)  # a stale socket of a dead holder
            old = os.umask(0o177)  # only this user's ranks may talk to it
            try:
                self._servers.append(_UnixServer(socket_path, self._handler(tcp=False)))
            finally:
                os.umask(old)
        if bind:
            self._servers.append(
                _TCPServer(bind, self._handler(tcp=True), self.unauthenticated, self.refused)
            )
        if not self._servers:
            raise ValueError("a snapshot holder needs a socket path or a TCP address")

    @property
    def tcp_port(self) -> int | None:
        for s in self._servers:
            if isinstance(s, _TCPServer):
                return s.server_address[1]
        return None

    def _handler(self, tcp: bool):
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                sock.settimeout(IDLE_SECONDS)
                # a TCP peer proves the token before anything else (no payload until then),
                # by a deadline: an idle or trickling peer holds a thread and a slot
                shake = wire.ServerHandshake(server.token) if tcp else None
                deadline = time.monotonic() + server.handshake_seconds if tcp else None
                while True:
                    unread = 0  # payload bytes still on the socket
                    try:
                        header = wire.recv_header(sock, deadline)
                        unread = header.get("size", 0)
                        if shake is not None and not shake.done:
                            if header.get("size", 0):
                                raise wire.WireError("authenticate first", "unauthenticated")
                            answer, payload, data = shake.answer(header), b"", None
                            if shake.done:  # trusted from now on: a local rank's terms
                                deadline = None
                                sock.settimeout(IDLE_SECONDS)
                                server.unauthenticated.give_back(sock)
                        else:
                            req = wire.parse_request(header, server.max_snapshot_bytes)
                            # size checked above; a put fills a dropped snapshot's buffer
                            spare = server.store.spare(req.size) if req.op == "put" else None
                            data = wire.recv_payload(sock, header, into=spare)
                            unread = 0
                            answer, payload = server.dispatch(req, data)
                    except TimeoutError:
                        if deadline is not None:
                            server.refused["handshake_timeout"] += 1
                        return
                    except (EOFError, OSError):
                        return
                    except wire.WireError as exc:
                        server.refused[exc.reason] += 1
                        with contextlib.suppress(OSError):
                            wire.send_frame(sock, {"ok": False, "error": str(exc)})
                        if exc.reason == "bad_request" and not unread:
                            continue  # the frame was read whole: the connection is in step
                        return  # unread payload, or an untrusted peer: hang up
                    try:
                        wire.send_frame(sock, answer, payload)
                    except OSError:
                        return
                    data = payload = None  # not kept while waiting: a spare is unreferenced

        return Handler

    def dispatch(self, req: wire.Request, data: bytearray) -> tuple[dict, bytes]:
        self.requests[req.op] += 1
        if req.op == "put":
            # the payload's buffer is this request's own: held as it is, not copied
            held = Held(job=req.job, step=req.step, rank=req.rank, world=req.world,
                        local_world=req.local_world, checksum=req.checksum, data=data,
                        kind=REPLICA if req.replica else LOCAL)  # fmt: skip
            evicted = self.store.put(held, req.keep)
            if self.replicator and held.kind == LOCAL:
                self.replicator.submit({"op": "put", "job": req.job, "step": req.step,
                                        "rank": req.rank, "world": req.world,
                                        "local_world": req.local_world, "keep": req.keep,
                                        "checksum": req.checksum, "replica": True},
                                       held.data)  # fmt: skip
            return {"ok": True, "evicted": evicted}, b""
        if req.op == "list":
            if req.all_ranks:
                return {"ok": True, "snapshots": self.store.listing_all(req.job)}, b""
            return {"ok": True, "snapshots": self.store.listing(req.job, req.rank, req.world)}, b""
        if req.op == "get":
            held = self.store.get(req.job, req.step, req.rank, req.kind)
            if held is None:
                raise wire.WireError("no such snapshot")
            return {"ok": True, "checksum": held.checksum, "kind": held.kind}, held.data
        if req.op == "truncate":
            dropped = self.store.truncate(req.job, req.after)
            if self.replicator and not req.replica:
                self.replicator.submit({"op": "truncate", "job": req.job, "after": req.after,
                                        "replica": True})  # fmt: skip
            return {"ok": True, "dropped": dropped}, b""
        if req.op == "corrupt":
            if not self.store.corrupt(req.job, req.step, req.rank, req.kind):
                raise wire.WireError("no such snapshot")
            return {"ok": True}, b""
        if req.op == "status":
            return self.status_model().to_json(), b""
        raise wire.WireError(f"{req.op}: not expected now")  # hello/auth after the handshake

    def status_model(self) -> wire.HolderStatus:
        return wire.HolderStatus(
            pid=os.getpid(), uptime_seconds=round(time.time() - self.started, 1),
            **self.store.status(),
            replication=self.replicator.status() if self.replicator else None,
            requests=dict(self.requests), refused=dict(self.refused),
        )  # fmt: skip

    def status(self) -> dict:
        return self.status_model().to_json()

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

    def __init__(self, address, handler, slots: PeerSlots, refused: collections.Counter):
        self.slots, self.refused = slots, refused
        super().__init__(address, handler)

    def verify_request(self, request, client_address) -> bool:
        # in the accept loop, before a thread is started: a refused connection costs none
        if self.slots.take(request, client_address[0]):
            return True
        self.refused["too_many_unauthenticated"] += 1
        return False

    def shutdown_request(self, request) -> None:
        self.slots.give_back(request)  # every accepted connection ends here, however it ends
        super().shutdown_request(request)
