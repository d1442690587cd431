"""The snapshot holder's wire format (tier-0 in-memory snapshots; stdlib only).

One request per frame, one answer per request, on a stream socket (unix or TCP):

    frame = 4-byte big-endian header length | JSON header | `size` bytes of payload

The header is an object with `op` (requests) or `ok` (answers); a payload follows only
when the header has `size` > 0. Ops: `put` (a snapshot: job, step, rank, world, checksum,
size; `replica` when a holder forwards it to its peer), `list` (job, rank, world: the steps
held for that rank; `all_ranks`: every rank's, any world), `get` (job, step, rank: the
bytes), `truncate` (job, after: drop steps newer than a resumed state), `status`, `corrupt`
(fault injection: flips one byte of a held snapshot, like `rankguard inject
corrupt-checkpoint` does on disk), and on TCP first `hello` + `auth` (below).

A request's header is checked by `parse_request` (types, ranges, the payload's size against
the holder's limit) *before* the holder reads or allots memory for its payload
(`recv_header` and `recv_payload` are apart for that reason).

**TCP is authenticated** (holders on other nodes, ranks fetching a lost node's replica):
both ends prove they hold the cluster's snapshot token without sending it, by HMAC-SHA256
over fresh nonces (client `hello` with its nonce, the server answers its own; the client
sends its proof in `auth`, the server checks it and answers its proof, which the client
checks). Until then the holder takes no other op and no payload, and gives it a few
seconds (a connection from a peer address that already has a few unauthenticated ones is
closed at once). The unix socket is owner-only (mode 0600): no token.

`HolderStatus` is the holder's `status` answer as a typed model; the agent reads it to show
snapshot memory on `/v1/node` and `/metrics`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import crc
from .secrets import read_secret_file

MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 64 * 1024**3  # a sanity bound on one rank's snapshot (64 GiB)
MAX_NAME = 256  # job names, checksums, addresses
MAX_STEP = 2**63 - 1
_LEN = struct.Struct(">I")

OPS = ("put", "list", "get", "truncate", "status", "corrupt", "hello", "auth")
KINDS = ("local", "replica")
#: Why the holder refused a request or a connection (a bounded set: a counter's labels).
#: `handshake_timeout`: a TCP peer that did not finish the handshake in time;
#: `too_many_unauthenticated`: one more pre-handshake connection from a peer address at its cap.
REFUSALS = ("malformed", "too_large", "unauthenticated", "auth_failed", "bad_request",
            "handshake_timeout", "too_many_unauthenticated")  # fmt: skip


class WireError(Exception):
    """A malformed frame or an answer with ok=false; the message says why. `reason` is one
    of REFUSALS when the holder refuses a request."""

    def __init__(self, message: str, reason: str = "bad_request"):
        super().__init__(message)
        self.reason = reason


def checksum(data) -> str:
    """Integrity, not tamper resistance (who may put is checked by the socket's credentials
    or the token): CRC-32, 4x cheaper than BLAKE2b (34 against 141 ms on 130 MB here), and
    the sender's checksum is CPU taken from training every snapshot. zlib releases the GIL
    above 5 KiB, and a large buffer is checksummed on several cores (`contract/crc.py`: the
    same value). The prefix names the algorithm: a copy saved with another (BLAKE2b before
    session 12) does not verify and is refused, never misread."""
    return f"crc32:{crc.crc32(data):08x}"


def parse_address(addr: str) -> tuple[int, object]:
    """`/path/to.sock` or `unix:/path` -> AF_UNIX; `host:port` -> AF_INET. Raises ValueError."""
    if not addr:
        raise ValueError("empty snapshot holder address")
    if addr.startswith("unix:"):
        return socket.AF_UNIX, addr[5:]
    if "/" in addr or addr.endswith(".sock"):
        return socket.AF_UNIX, addr
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"snapshot holder address {addr!r}: expected a socket path or HOST:PORT")
    return socket.AF_INET, (host.strip("[]") or "127.0.0.1", int(port))


# ------------------------------------------------------------------------------ the token


def read_token(path) -> str:
    """The snapshot token from an owner-only file (like the agent's); ValueError says why."""
    try:
        return read_secret_file(path, "token").decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"token file {path}: not text ({exc})") from None


def proof(token: str, role: str, first: str, second: str) -> str:
    """HMAC-SHA256 of the role and both nonces: a proof of the token that a peer cannot
    replay (fresh nonces) or reflect (the role is part of it)."""
    msg = f"rankguard-snapshot-{role}\0{first}\0{second}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def _nonce(h: Mapping[str, Any], name: str) -> str:
    v = h.get(name)
    if not isinstance(v, str) or not 32 <= len(v) <= 128:
        raise WireError(f"{name}: expected a nonce of 32 to 128 characters", "malformed")
    return v


def client_handshake(sock: socket.socket, token: str) -> None:
    """Prove the token to a holder on TCP and check the holder's proof; WireError if
    either side does not hold it. The client proves first, so a holder counts every peer
    with a wrong token."""
    mine = secrets.token_hex(16)
    send_frame(sock, {"op": "hello", "nonce": mine})
    answer, _ = recv_frame(sock, max_payload=0)
    if not answer.get("ok"):
        raise WireError(str(answer.get("error", "refused")), "auth_failed")
    theirs = _nonce(answer, "nonce")
    send_frame(sock, {"op": "auth", "proof": proof(token, "client", theirs, mine)})
    answer, _ = recv_frame(sock, max_payload=0)
    if not answer.get("ok"):
        raise WireError(str(answer.get("error", "refused")), "auth_failed")
    got = answer.get("proof")
    if not isinstance(got, str) or not hmac.compare_digest(
        got, proof(token, "server", mine, theirs)
    ):
        raise WireError("the holder did not prove the snapshot token", "auth_failed")


class ServerHandshake:
    """The holder's side of the handshake on one connection (pure: frames in, frames out):
    `hello` (the client's nonce) -> our nonce; `auth` (the client's proof) -> our proof."""

    def __init__(self, token: str):
        self.token = token
        self.client_nonce: str | None = None
        self.nonce = secrets.token_hex(16)
        self.done = False

    def answer(self, h: Mapping[str, Any]) -> dict:
        """The answer to `hello` or `auth`; WireError (reason unauthenticated/auth_failed)
        for anything else, or a wrong proof."""
        op = h.get("op")
        if op == "hello" and self.client_nonce is None:
            self.client_nonce = _nonce(h, "nonce")
            return {"ok": True, "nonce": self.nonce}
        if op == "auth" and self.client_nonce is not None:
            got = h.get("proof")
            want = proof(self.token, "client", self.nonce, self.client_nonce)
            if not isinstance(got, str) or not hmac.compare_digest(got, want):
                raise WireError("authentication failed", "auth_failed")
            self.done = True
            return {"ok": True, "proof": proof(self.token, "server", self.client_nonce, self.nonce)}
        raise WireError("authenticate first (hello, auth)", "unauthenticated")


# ------------------------------------------------------------------------------- frames


def connect(addr: str, timeout: float = 10.0, token: str | None = None) -> socket.socket:
    """A connection to a holder; on TCP authenticated with `token` (WireError without one,
    or when the holder refuses it)."""
    family, target = parse_address(addr)
    if family == socket.AF_INET and not token:
        raise WireError(f"{addr}: a holder on TCP needs the snapshot token", "unauthenticated")
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(target)
        if family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, token)
    except BaseException:
        sock.close()
        raise
    return sock


def send_frame(sock: socket.socket, header: dict, payload=b"") -> None:
    head = json.dumps({**header, "size": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    if len(payload):
        sock.sendall(payload)


def _recv_exact(
    sock: socket.socket, n: int, into: bytearray | None = None, deadline: float | None = None
) -> bytearray:
    """n bytes, into `into` when it is a buffer of exactly n bytes (a holder's spare).
    `deadline` (time.monotonic()) bounds the whole read, TimeoutError after it: a socket
    timeout alone bounds each recv, which a peer sending a byte at a time renews."""
    buf = into if into is not None and len(into) == n else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], min(n - got, 8 * 1024 * 1024))
        if k == 0:
            raise EOFError("connection closed mid-frame" if got else "connection closed")
        got += k
    return buf


def decode_header(raw: bytes | bytearray) -> dict:
    """A header's JSON object with a valid `size`; WireError (malformed) otherwise."""
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:
        raise WireError(f"header is not JSON: {exc}", "malformed") from None
    if not isinstance(header, dict):
        raise WireError("header is not an object", "malformed")
    size = header.get("size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_PAYLOAD:
        raise WireError(f"bad payload size {size!r}", "malformed")
    return header


def recv_header(sock: socket.socket, deadline: float | None = None) -> dict:
    """The next frame's header; its payload (`size` bytes) is still on the socket.
    TimeoutError when it is not all there by `deadline` (time.monotonic())."""
    (n,) = _LEN.unpack(_recv_exact(sock, 4, deadline=deadline))
    if n > MAX_HEADER:
        raise WireError(f"header of {n} bytes (at most {MAX_HEADER})", "too_large")
    return decode_header(_recv_exact(sock, n, deadline=deadline))


def recv_payload(
    sock: socket.socket, header: Mapping[str, Any], into: bytearray | None = None
) -> bytearray:
    size = header.get("size", 0)
    return _recv_exact(sock, size, into) if size else bytearray()


def recv_frame(sock: socket.socket, max_payload: int = MAX_PAYLOAD) -> tuple[dict, bytearray]:
    header = recv_header(sock)
    if header.get("size", 0) > max_payload:
        raise WireError(f"payload of {header['size']} bytes (at most {max_payload})", "too_large")
    return header, recv_payload(sock, header)


def request(
    addr: str, header: dict, payload=b"", timeout: float = 30.0, token: str | None = None
) -> tuple[dict, bytearray]:
    """One request on a fresh connection; raises OSError/EOFError (unreachable) or WireError
    (the holder refused, with its reason)."""
    with connect(addr, timeout, token) as sock:
        # The holder may refuse on the header alone and close before reading the payload:
        # its answer is already on the socket, and it is the reason to show.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            send_frame(sock, header, payload)
        answer, data = recv_frame(sock)
    if not answer.get("ok"):
        raise WireError(str(answer.get("error", "refused")))
    return answer, data


def default_address(environ=os.environ) -> str | None:
    return environ.get("RANKGUARD_SNAPSHOT_HOLDER") or None


# ------------------------------------------------------------------------------ requests


def _str(h: Mapping[str, Any], name: str) -> str:
    v = h.get(name)
    if not isinstance(v, str) or not v or len(v) > MAX_NAME:
        raise WireError(f"{name}: expected a non-empty string of at most {MAX_NAME} characters")
    return v


def _int(h: Mapping[str, Any], name: str, low: int = 0, high: int = MAX_STEP) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise WireError(f"{name}: expected an integer in [{low}, {high}]")
    return v


@dataclass(frozen=True)
class Request:
    """A checked request header. Fields an op does not use keep their defaults."""

    op: str
    size: int = 0
    job: str = ""
    step: int = 0
    rank: int = 0
    world: int = 1
    local_world: int = 1
    keep: int = 1
    checksum: str = ""
    after: int = 0
    kind: str | None = None
    replica: bool = False
    all_ranks: bool = False


def parse_request(h: Mapping[str, Any], max_payload: int = MAX_PAYLOAD) -> Request:
    """Check a request header before its payload is read: the op, every field it needs
    (types and ranges), and the payload's size (only `put` carries one, at most
    `max_payload` bytes). WireError names the first bad field; reason too_large for a
    payload over the limit."""
    op = h.get("op")
    if op not in OPS:
        raise WireError(f"unknown op {str(op)[:32]!r}")
    size = _int(h, "size", 0, MAX_PAYLOAD) if "size" in h else 0
    if op != "put" and size:
        raise WireError(f"{op}: carries no payload")
    kind = h.get("kind")
    if kind is not None and kind not in KINDS:
        raise WireError("kind: local or replica")
    if op == "put":
        if size > max_payload:
            raise WireError(f"snapshot of {size} bytes (at most {max_payload})", "too_large")
        world = _int(h, "world", 1, 1 << 24)
        return Request(op, size, _str(h, "job"), _int(h, "step"), _int(h, "rank", 0, world - 1),
                       world, _int(h, "local_world", 1, world), _int(h, "keep", 1, 1 << 16),
                       _str(h, "checksum"), replica=h.get("replica") is True)  # fmt: skip
    if op == "list":
        if h.get("all_ranks") is True:
            return Request(op, job=_str(h, "job"), all_ranks=True)
        return Request(op, job=_str(h, "job"), rank=_int(h, "rank"), world=_int(h, "world", 1))
    if op == "get":
        return Request(op, job=_str(h, "job"), step=_int(h, "step"), rank=_int(h, "rank"),
                       kind=kind)  # fmt: skip
    if op == "truncate":
        return Request(op, job=_str(h, "job"), after=_int(h, "after"),
                       replica=h.get("replica") is True)  # fmt: skip
    if op == "corrupt":
        return Request(op, job=_str(h, "job"), step=_int(h, "step"), rank=_int(h, "rank"),
                       kind=kind or "local")  # fmt: skip
    return Request(op)  # status, hello, auth (the handshake checks its own fields)


# ---------------------------------------------------------------------- the status model


def _counts(v: Any, name: str, max_items: int = 64) -> dict[str, int]:
    if not isinstance(v, Mapping) or len(v) > max_items:
        raise WireError(f"{name}: expected an object of at most {max_items} counters")
    out = {}
    for k in v:
        if not isinstance(k, str) or len(k) > 64:
            raise WireError(f"{name}: bad counter name")
        out[k] = _int(v, k)
    return out


@dataclass(frozen=True)
class StepHeld:
    """One step of one job held by a holder, as a local copy or a replica."""

    job: str
    kind: str
    step: int
    ranks: tuple[int, ...]
    complete: bool
    bytes: int

    def to_json(self) -> dict:
        return {"job": self.job, "kind": self.kind, "step": self.step, "ranks": list(self.ranks),
                "complete": self.complete, "bytes": self.bytes}  # fmt: skip

    @classmethod
    def from_json(cls, o: Any) -> StepHeld:
        if not isinstance(o, Mapping):
            raise WireError("snapshots[]: expected an object")
        ranks = o.get("ranks")
        if not isinstance(ranks, list) or len(ranks) > 1 << 16:
            raise WireError("ranks: expected a list")
        kind = o.get("kind")
        if kind not in KINDS:
            raise WireError("kind: local or replica")
        if not isinstance(o.get("complete"), bool):
            raise WireError("complete: expected true or false")
        return cls(_str(o, "job"), kind, _int(o, "step"),
                   tuple(_int({"r": r}, "r") for r in ranks), o["complete"],
                   _int(o, "bytes"))  # fmt: skip


@dataclass(frozen=True)
class JobMemory:
    """What a holder holds of one job, as local copies or as replicas (the agent's view)."""

    job: str
    kind: str
    bytes: int
    snapshots: int  # rank snapshots (a step of a 4-rank node is 4)
    steps: int
    newest_step: int | None
    newest_complete_step: int | None

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class HolderStatus:
    """The holder's `status` answer (`rankguard snapshot-holder status --json`)."""

    pid: int
    uptime_seconds: float
    bytes: int
    evicted: int
    max_keep: int
    keep: dict[str, int] = field(default_factory=dict)
    snapshots: tuple[StepHeld, ...] = ()
    replication: dict | None = None  # peer, sent, dropped, failures, pending, last_error
    requests: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    spare_bytes: int = 0  # buffers of dropped snapshots, kept to receive the next ones into

    MAX_STEPS = 4096  # entries in one answer: far above keep x jobs, far below a problem

    def to_json(self) -> dict:
        return {"ok": True, "pid": self.pid, "uptime_seconds": self.uptime_seconds,
                "bytes": self.bytes, "evicted": self.evicted, "max_keep": self.max_keep,
                "keep": dict(self.keep), "snapshots": [s.to_json() for s in self.snapshots],
                "replication": self.replication, "requests": dict(self.requests),
                "refused": dict(self.refused), "spare_bytes": self.spare_bytes}  # fmt: skip

    @classmethod
    def from_json(cls, o: Any) -> HolderStatus:
        """Every field checked (types, ranges, sizes); WireError names the first bad one."""
        if not isinstance(o, Mapping):
            raise WireError("status: expected an object")
        steps = o.get("snapshots")
        if not isinstance(steps, list) or len(steps) > cls.MAX_STEPS:
            raise WireError(f"snapshots: expected a list of at most {cls.MAX_STEPS}")
        up = o.get("uptime_seconds")
        if isinstance(up, bool) or not isinstance(up, int | float) or not 0 <= up < 1e12:
            raise WireError("uptime_seconds: expected a number")
        rep = o.get("replication")
        if rep is not None:
            if not isinstance(rep, Mapping):
                raise WireError("replication: expected an object or null")
            err = rep.get("last_error")
            rep = {"peer": _str(rep, "peer"),
                   **{k: _int(rep, k) for k in ("sent", "dropped", "failures", "pending")},
                   "last_error": err[:MAX_NAME] if isinstance(err, str) else None}  # fmt: skip
        return cls(_int(o, "pid"), float(up), _int(o, "bytes"), _int(o, "evicted"),
                   _int(o, "max_keep"), _counts(o.get("keep"), "keep", cls.MAX_STEPS),
                   tuple(StepHeld.from_json(s) for s in steps), rep,
                   _counts(o.get("requests"), "requests"),
                   _counts(o.get("refused"), "refused"),
                   _int(o, "spare_bytes") if "spare_bytes" in o else 0)  # fmt: skip

    def jobs(self) -> list[JobMemory]:
        """Per (job, kind): bytes, rank snapshots, steps, the newest and newest complete step."""
        by: dict[tuple[str, str], list[StepHeld]] = {}
        for s in self.snapshots:
            by.setdefault((s.job, s.kind), []).append(s)
        out = []
        for (job, kind), held in sorted(by.items()):
            complete = [s.step for s in held if s.complete]
            out.append(JobMemory(job, kind, sum(s.bytes for s in held),
                                 sum(len(s.ranks) for s in held), len(held),
                                 max(s.step for s in held), max(complete, default=None)))  # fmt: skip
        return out
