"""The snapshot holder's wire format (tier-0 in-memory snapshots; stdlib only).

One request per frame, one answer per request, on a stream socket (unix or TCP):

    frame = 4-byte big-endian header length | JSON header | `size` bytes of payload

The header is an object with `op` (requests) or `ok` (answers); a payload follows only
when the header has `size` > 0. Ops: `put` (a snapshot: job, step, rank, world, sha256,
size; `replica` when a holder forwards it to its peer), `list` (job, rank, world: the steps
held for that rank), `get` (job, step, rank: the bytes), `truncate` (job, after: drop steps
newer than a resumed state), `status`, `corrupt` (fault injection: flips one byte of a held
snapshot, like `rankguard inject corrupt-checkpoint` does on disk).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct

MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 64 * 1024**3  # a sanity bound on one rank's snapshot (64 GiB)
_LEN = struct.Struct(">I")


class WireError(Exception):
    """A malformed frame or an answer with ok=false; the message says why."""


def checksum(data) -> str:
    """Integrity, not tamper resistance: BLAKE2b is faster than SHA-256 on a CPU and, like
    it, releases the GIL on large buffers."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


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


def connect(addr: str, timeout: float = 10.0) -> socket.socket:
    family, target = parse_address(addr)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(target)
    except OSError:
        sock.close()
        raise
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_frame(sock: socket.socket, header: dict, payload=b"") -> None:
    head = json.dumps({**header, "size": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    if len(payload):
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 8 * 1024 * 1024))
        if k == 0:
            raise EOFError("connection closed mid-frame" if got else "connection closed")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[dict, bytearray]:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise WireError(f"header of {n} bytes (at most {MAX_HEADER})")
    try:
        header = json.loads(bytes(_recv_exact(sock, n)))
    except ValueError as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not an object")
    size = header.get("size", 0)
    if not isinstance(size, int) or not 0 <= size <= MAX_PAYLOAD:
        raise WireError(f"bad payload size {size!r}")
    return header, _recv_exact(sock, size) if size else bytearray()


def request(addr: str, header: dict, payload=b"", timeout: float = 30.0) -> tuple[dict, bytearray]:
    """One request on a fresh connection; raises OSError/EOFError (unreachable) or WireError
    (the holder refused, with its reason)."""
    with connect(addr, timeout) as sock:
        send_frame(sock, header, payload)
        answer, data = recv_frame(sock)
    if not answer.get("ok"):
        raise WireError(str(answer.get("error", "refused")))
    return answer, data


def default_address(environ=os.environ) -> str | None:
    return environ.get("RANKGUARD_SNAPSHOT_HOLDER") or None
